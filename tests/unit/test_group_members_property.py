"""Property tests of the group-member rule over random group compositions: members that
are valid, empty, failed resets, lost scores, cut turns, with random versions, through
group making, the replay queue's staleness bound, the group filter, the advantages and
the plan's slots (the loss weights: only slotted tokens get a loss term). And random
degenerate runs through the real orchestrator on a virtual clock: every admitted prompt
ends trained once or dropped once with a reason, none runs again more than
run.max_readmissions times."""

from __future__ import annotations

import contextlib
from pathlib import Path

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_rl.control.failures import RunFailed
from buffers.common.records import NO_VERSION, Group, Prompt, Sample, make_group
from buffers.plan.advantages import group_advantages, has_signal
from buffers.plan.batching import shard_batches, training_rewards, with_reward_failures
from buffers.queue.errors import NotEnoughGroups
from buffers.queue.replay_queue import ReplayQueue
from tests.unit.orchestrator_fakes import (
    FakeRollout,
    FakeTrainer,
    config,
    ledger,
    run,
    trained_once_or_unfinished,
)
from workers.trainer.config import TrainerConfig

PROMPT = Prompt(prompt_id="p", text="1+1=", answer="2")
KINDS = ("valid", "empty", "failed_reset", "lost_score", "cut_turn", "observation_only")


@st.composite
def members(draw: st.DrawFn) -> tuple[str, Sample]:
    kind = draw(st.sampled_from(KINDS))
    version = draw(st.integers(0, 6))
    n = draw(st.integers(1, 12))
    reward = draw(st.sampled_from((0.0, 0.5, 1.0)))
    policy = Sample(token_ids=(3,) * n, logprobs=(-0.2,) * n, versions=(version,) * n,
                    finish_reason="stop", text="t", reward=reward)
    if kind == "valid":
        return kind, policy
    if kind == "cut_turn":
        return kind, msgspec.structs.replace(policy, finish_reason="length",
                                             longest_turn=max(1, n // 2))
    if kind == "lost_score":
        return kind, msgspec.structs.replace(policy, reward=0.0, reward_failed=True)
    if kind == "observation_only":
        return kind, Sample(token_ids=(9,) * n, logprobs=(0.0,) * n,
                            versions=(NO_VERSION,) * n, finish_reason="stop", text="",
                            loss_mask=(0,) * n)
    if kind == "failed_reset":
        return kind, Sample(token_ids=(), logprobs=(), versions=(), finish_reason="abort",
                            text="", env_outcome="error", excluded="env_error")
    return kind, Sample(token_ids=(), logprobs=(), versions=(), finish_reason="stop",
                        text="")  # an empty completion: no policy token either


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(members(), min_size=1, max_size=8), st.booleans(),
       st.sampled_from(("none", "mask", "penalty")), st.integers(0, 2), st.integers(0, 8))
def test_only_members_reach_the_advantages_the_filter_and_the_loss(
        drawn: list[tuple[str, Sample]], zero_lost: bool, overlong: str, max_staleness: int,
        at_version: int) -> None:
    kinds = [kind for kind, _ in drawn]
    group = make_group(PROMPT, (1, 2), [s for _, s in drawn])
    if zero_lost:
        group = with_reward_failures(group)
    expected = [k for k, kind in enumerate(kinds)
                if kind in ("valid", "cut_turn") or (kind == "lost_score" and zero_lost)]
    assert list(group.members) == expected
    versioned = [s.min_version for kind, s in drawn if kind in ("valid", "cut_turn",
                                                                "lost_score")]
    assert group.min_version == min(versioned, default=NO_VERSION)  # never an invented 0
    trainer = TrainerConfig(overlong=overlong, overlong_buffer=2)  # type: ignore[arg-type]
    rewards = training_rewards(group, trainer, max_new_tokens=8)
    assert len(rewards) == len(expected)
    if overlong != "penalty":
        assert rewards == [group.rewards[k] for k in expected]
    if len(group.members) < 2:
        return  # the orchestrator runs such a prompt again: it is never queued
    # The staleness bound holds whatever the members: a group is taken or dropped.
    dropped: list[object] = []
    queue: ReplayQueue[Group] = ReplayQueue(max_groups=4, max_tokens=10**6,
                                            max_staleness=max_staleness,
                                            on_drop=dropped.append)

    taken: list[Group] = []
    if queue.put_nowait(group):
        with contextlib.suppress(NotEnoughGroups):  # dropped as stale by the take
            taken = queue.take_nowait(1, at_version=max(at_version, group.max_version))
    assert len(taken) + len(dropped) == 1
    if not taken:
        assert max(at_version, group.max_version) - group.min_version > max_staleness
        return
    batches, _ = shard_batches(taken, 1, trainer, step=1, max_new_tokens=8)
    slots = [slot for mb in batches[0].micro_batches for slot in mb]
    trained = {slot.sample: slot.advantage for slot in slots}
    assert len(slots) == len(trained)  # no member trained twice
    assert set(trained) <= set(expected)  # no excluded sample gets a loss term
    if overlong == "mask":
        assert set(trained) == {k for k in expected if kinds[k] != "cut_turn"}
    else:
        assert set(trained) == set(expected)
    want = dict(zip(expected, group_advantages(rewards), strict=True))
    assert all(trained[k] == pytest.approx(want[k]) for k in trained)
    if not has_signal(rewards):
        assert all(a == 0.0 for a in trained.values())


class ScriptedRollout(FakeRollout):
    """Prompt index i's group is degenerate (no member) on the attempts ``script`` says."""

    def __init__(self, rank: int, script: dict[int, frozenset[int]]) -> None:
        super().__init__(rank)
        self.script = script

    async def generate(self, prompt: Prompt) -> Group:
        index = int(prompt.prompt_id.rsplit("-", 1)[-1])
        if prompt.attempt not in self.script.get(index % len(self.script), frozenset()):
            return await super().generate(prompt)
        await anyio.sleep(self.delay)
        empty = Sample(token_ids=(), logprobs=(), versions=(), finish_reason="abort",
                       text="", env_outcome="error", excluded="env_error")
        return make_group(prompt, (1, 2), [empty] * 4, rollout_rank=self.rank)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(st.frozensets(st.integers(0, 6), max_size=7), min_size=2, max_size=5),
       st.integers(0, 2), st.integers(0, 3))
def test_every_admitted_prompt_ends_trained_once_or_dropped_once_with_a_reason(
        tmp_path_factory: pytest.TempPathFactory, script: list[frozenset[int]],
        max_staleness: int, max_readmissions: int) -> None:
    out: Path = tmp_path_factory.mktemp("run")
    cfg = config(out, steps=3, max_staleness=max_staleness)
    cfg = msgspec.structs.replace(
        cfg, run=msgspec.structs.replace(cfg.run, max_readmissions=max_readmissions,
                                         eval_every=0),
        rollout=msgspec.structs.replace(cfg.rollout, stall_timeout_s=0.5))
    scripted = dict(enumerate(script))
    # Every prompt degenerate on every attempt it gets: nothing can train, and the run
    # must say so (a rollout stall), never spin.
    hopeless = all(set(range(max_readmissions + 1)) <= attempts for attempts in script)
    try:
        summary = run(cfg, {0: ScriptedRollout(0, scripted),
                            1: ScriptedRollout(1, scripted)}, [FakeTrainer(0)], virtual=True)
    except RunFailed as failed:
        assert hopeless and "rollout stall" in str(failed)
    else:
        assert summary.steps == 3 and not hopeless
        trained_once_or_unfinished(ledger(out))
    events = ledger(out)
    assert len(events) > 0
    for history in events.values():
        assert max(int(e["attempt"]) for e in history) <= max_readmissions  # type: ignore[call-overload]
        finals = [e for e in history if e["event"] == "trained"
                  or e["reason"] == "readmissions_exhausted"]
        assert len(finals) <= 1
