"""A group's members are the trajectories the policy wrote and the task scored: the rest
(no policy token, a failed or over-long reset, an excluded environment failure, a lost
reward score) leave the advantages, the filter and the loss, are counted by reason, and a
group left with fewer than two members runs again, a bounded number of times. Also: a
stale drop is no progress, a graceful stop that cannot finish its step ends within
run.stop_timeout_s, and over-long penalties and masks read each policy turn."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from async_rl.config import Config
from async_rl.control.checkpoint_files import latest_checkpoint
from async_rl.control.orchestrator import Orchestrator
from buffers.common.records import (
    NO_POLICY_TOKEN,
    NO_VERSION,
    REWARD_FAILED,
    Group,
    Prompt,
    Sample,
    make_group,
)
from buffers.plan.advantages import has_signal
from buffers.plan.batching import shard_batches, training_rewards, with_reward_failures
from buffers.queue.replay_queue import ReplayQueue
from tests.unit.orchestrator_fakes import (
    FakeRollout,
    FakeTrainer,
    config,
    ledger,
    run,
    trained_once_or_unfinished,
)
from tests.unit.turn_fakes import ByteTokenizer, Params
from workers.rollout.environment import EnvironmentConfig
from workers.rollout.prompts import PromptFormat
from workers.rollout.turns import TurnRunner
from workers.trainer.config import TrainerConfig

PROMPT = Prompt(prompt_id="p0", text="2+2=", answer="4")


def sample(reward: float, *, tokens: int = 3, version: int = 0, failed: bool = False,
           finish: str = "stop", excluded: str = "", longest_turn: int = -1) -> Sample:
    return Sample(token_ids=(5,) * tokens, logprobs=(-0.5,) * tokens,
                  versions=(version,) * tokens, finish_reason=finish, text="x",
                  reward=reward, reward_failed=failed, excluded=excluded,
                  longest_turn=longest_turn)


def failed_reset() -> Sample:
    """What ``TurnRunner`` makes of a trajectory whose reset raised."""
    return Sample(token_ids=(), logprobs=(), versions=(), finish_reason="abort", text="",
                  env_outcome="error", excluded="env_error")


def advantages(group: Group, trainer: TrainerConfig | None = None,
               max_new_tokens: int | None = None) -> dict[int, float]:
    """Each trained sample's advantage, by its index in the group."""
    batches, _ = shard_batches([group], 1, trainer or TrainerConfig(), step=1,
                               max_new_tokens=max_new_tokens)
    return {slot.sample: slot.advantage for mb in batches[0].micro_batches for slot in mb}


# ---- defect 2: failed resets are no reward-0 members ------------------------------------

def test_failed_resets_leave_the_group_instead_of_scoring_0() -> None:
    group = make_group(PROMPT, (1, 2), [sample(1.0) for _ in range(4)]
                       + [failed_reset() for _ in range(4)])
    assert group.members == (0, 1, 2, 3)
    assert group.excluded == ("",) * 4 + ("env_error",) * 4
    assert group.env_errors == 4
    # Four real trajectories all rewarded 1: no signal (today each got +0.935).
    assert not has_signal(training_rewards(group, TrainerConfig()))
    assert advantages(group) == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}


def test_a_sample_without_a_policy_token_has_no_version_and_is_no_member() -> None:
    observation_only = Sample(token_ids=(9, 9), logprobs=(0.0, 0.0),
                              versions=(NO_VERSION, NO_VERSION), finish_reason="stop",
                              text="", loss_mask=(0, 0))
    assert observation_only.min_version == NO_VERSION
    assert observation_only.exclusion == NO_POLICY_TOKEN
    group = make_group(PROMPT, (1,), [sample(1.0, version=3), observation_only,
                                      sample(0.0, version=5)])
    assert group.members == (0, 2)
    assert (group.min_version, group.max_version) == (3, 5)  # never an invented 0
    nobody = make_group(PROMPT, (1,), [failed_reset(), failed_reset()])
    assert nobody.members == () and nobody.min_version == NO_VERSION


# ---- defect 5: a lost reward score is no 0 ------------------------------------------------

def test_a_lost_reward_score_is_excluded_by_default_and_zero_on_request() -> None:
    # All four answers correct, one verifier too slow: today advantages (.5, .5, -1.5, .5).
    group = make_group(PROMPT, (1,), [sample(1.0), sample(1.0), sample(0.0, failed=True),
                                      sample(1.0)])
    assert group.excluded[2] == REWARD_FAILED and group.reward_failures == 1
    assert advantages(group) == {0: 0.0, 1: 0.0, 3: 0.0}  # no signal, and 2 not trained
    zero = with_reward_failures(group)
    assert zero.members == (0, 1, 2, 3)
    scored = advantages(zero)
    assert len(scored) == 4 and scored[2] < 0 < scored[0]


# ---- defect 3: lengths are counted per policy turn ----------------------------------------

def test_the_overlong_penalty_reads_the_longest_policy_turn_not_the_trajectory() -> None:
    trainer = TrainerConfig(overlong="penalty", overlong_buffer=16)
    # Four 20-token turns with 30-token observations: 170 tokens, cap 64 per turn.
    long_trajectory = sample(1.0, tokens=170, longest_turn=20)
    group = make_group(PROMPT, (1,), [long_trajectory, sample(0.0, tokens=170,
                                                              longest_turn=20)])
    assert training_rewards(group, trainer, max_new_tokens=64) == [1.0, 0.0]  # was 0.0, -1
    cut_turn = make_group(PROMPT, (1,), [sample(1.0, tokens=170, longest_turn=64),
                                         sample(0.0, tokens=30, longest_turn=30)])
    assert training_rewards(cut_turn, trainer, max_new_tokens=64) == [0.0, 0.0]


class StepEnv:
    """Answers every turn with an observation, never done."""

    async def reset(self, row: dict[str, Any]) -> str:
        return str(row["prompt"])

    async def step(self, completion: str) -> Any:
        import async_rl

        return async_rl.EnvStep("++", 0.25, False)


class TooLongEnv(StepEnv):
    async def reset(self, row: dict[str, Any]) -> str:
        return "x" * 40


def play(env: type, lengths: list[int], **knobs: Any) -> list[Sample]:
    """One trajectory per call of ``TurnRunner.group`` with 2 members; the engine's turn
    k has ``lengths[k]`` tokens, cut at its budget (finish "length" when cut)."""
    turns = TurnRunner(EnvironmentConfig(class_="unused:Unused", **knobs), ByteTokenizer(),
                       PromptFormat(), max_new_tokens=6, make_environment=env)
    calls: list[int] = []

    async def stream(context: list[int], params: Any) -> Sample:
        want = lengths[min(len(calls) // 2, len(lengths) - 1)]
        calls.append(1)
        n = min(want, params.max_tokens)
        return Sample(token_ids=(7,) * n, logprobs=(-0.1,) * n, versions=(0,) * n,
                      finish_reason="length" if want > n else "stop", text="a" * n)

    try:
        return asyncio.run(turns.group(PROMPT, 2, stream, Params()))[1]
    finally:
        turns.close()


def test_a_turn_cut_at_max_new_tokens_marks_the_trajectory_whichever_turn_it_was() -> None:
    samples = play(StepEnv, [3, 9, 2], max_turns=3)  # the middle turn is cut at 6
    assert len(samples) == 2
    for played in samples:
        assert played.finish_reason == "length" and played.longest_turn == 6
    masked = TrainerConfig(overlong="mask")
    assert advantages(make_group(PROMPT, (1,), samples), masked) == {}
    uncut = play(StepEnv, [3, 4, 2], max_turns=3)
    assert [s.finish_reason for s in uncut] == ["stop", "stop"]
    assert [s.longest_turn for s in uncut] == [4, 4]


def test_a_reset_prompt_with_no_room_for_a_turn_is_refused_and_counted() -> None:
    samples = play(TooLongEnv, [3], max_trajectory_tokens=40)
    assert [(s.env_outcome, s.excluded, s.token_ids) for s in samples] == [
        ("too_long", "env_too_long", ())] * 2
    group = make_group(PROMPT, tuple(range(40)), samples)
    assert group.members == () and group.excluded == ("env_too_long",) * 2


# ---- defect 1: degenerate groups never wedge a run ----------------------------------------

class DegenerateRollout(FakeRollout):
    """Every third prompt (by its index) comes back with no policy token in any sample."""

    async def generate(self, prompt: Prompt) -> Group:
        if int(prompt.prompt_id.rsplit("-", 1)[-1]) % 3:
            return await super().generate(prompt)
        await anyio.sleep(self.delay)
        self.generated += 1
        return make_group(prompt, (1, 2), [failed_reset() for _ in range(4)],
                          rollout_rank=self.rank)


def test_groups_without_members_run_again_a_bounded_number_of_times_and_never_wedge(
        tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=6, max_staleness=1)
    summary = run(cfg, {0: DegenerateRollout(0), 1: DegenerateRollout(1)}, [FakeTrainer(0)],
                  virtual=True)
    assert summary.steps == 6 and not summary.stopped
    assert summary.failures["too_few_members"] > 0
    assert summary.failures["readmissions_exhausted"] > 0
    assert summary.failures["excluded_env_error"] == 4 * summary.failures["too_few_members"]
    events = ledger(tmp_path)
    trained_once_or_unfinished(events)
    attempts = [int(e["attempt"]) for h in events.values() for e in h]  # type: ignore[call-overload]
    assert len(attempts) > 0 and max(attempts) <= cfg.run.max_readmissions
    given_up = [p for p, h in events.items() if h[-1]["reason"] == "readmissions_exhausted"]
    assert len(given_up) == summary.failures["readmissions_exhausted"]
    assert all(int(p.rsplit("-", 1)[-1]) % 3 == 0 for p in given_up)


def test_a_group_dropped_as_stale_at_put_is_no_progress() -> None:
    dropped: list[object] = []
    queue: ReplayQueue[Group] = ReplayQueue(max_groups=4, max_tokens=10**6,
                                            max_staleness=0, on_drop=dropped.append)
    fresh = make_group(PROMPT, (1,), [sample(1.0, version=2), sample(0.0, version=2)])
    old = make_group(PROMPT, (1,), [sample(1.0, version=0), sample(0.0, version=0)])

    async def main() -> tuple[bool, bool]:
        assert await queue.put(fresh)
        await queue.take(1, at_version=2)
        return await queue.put(old), queue.put_nowait(old)

    assert anyio.run(main) == (False, False)
    assert len(dropped) == 2


# ---- a graceful stop never waits forever --------------------------------------------------

class StuckAfterOneStep(FakeRollout):
    """Generates four groups, then never finishes another (an engine that hangs)."""

    async def generate(self, prompt: Prompt) -> Group:
        if self.generated >= 4:
            await anyio.sleep_forever()
        return await super().generate(prompt)


def test_a_stop_whose_step_cannot_finish_ends_within_stop_timeout_s_and_resumes(
        tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=4)
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(
        cfg.run, stop_timeout_s=0.5, eval_every=0))
    asked: list[float] = []

    async def sigterm_while_waiting(orchestrator: Orchestrator) -> None:
        while not (orchestrator.version >= 1 and orchestrator._taking is not None):
            await anyio.sleep(0.01)
        await anyio.sleep(0.1)
        asked.append(time.perf_counter())
        orchestrator.request_stop("SIGTERM")

    summary = run(cfg, {0: StuckAfterOneStep(0)}, [FakeTrainer(0)],
                  beside=sigterm_while_waiting)
    took = time.perf_counter() - asked[0]
    assert summary.stopped == "SIGTERM" and summary.steps == 1
    assert took < cfg.run.stop_timeout_s + 3
    saved = latest_checkpoint(tmp_path)[1]
    assert saved is not None and saved.version == 1
    resumed = run(cfg, {0: FakeRollout(0)}, [FakeTrainer(0)], resume=True)
    assert resumed.steps == 4 and not resumed.stopped
    trained_once_or_unfinished(ledger(tmp_path))


def test_the_new_keys_are_checked() -> None:
    base = {"model": {"path": "unused"}}
    for key, section, value in (("max_readmissions", "run", -1),
                                ("stop_timeout_s", "run", 0),
                                ("on_reward_failure", "task", "drop")):
        kind = {"kind": "arithmetic"} if section == "task" else {}  # [task]'s tag
        with pytest.raises(msgspec.ValidationError, match=key):
            msgspec.convert({**base, section: {**kind, key: value}}, Config)
    with pytest.raises(msgspec.ValidationError, match="on_error"):
        msgspec.convert({**base, "task": {"kind": "arithmetic",
                                          "environment": {"on_error": "zero"}}}, Config)


# ---- rewards of multi-turn tasks see the policy's turns apart from the observations -----

class NumberEnv(StepEnv):
    """Observes a number after each turn (a tool's output a "last number" reward could
    mistake for the answer)."""

    async def step(self, completion: str) -> Any:
        import async_rl

        return async_rl.EnvStep("=99", 0.0, False)


def test_trl_rewards_get_a_trajectory_as_assistant_and_tool_messages() -> None:
    from workers.rewards.runner import UserRewards
    from workers.rollout.scoring import Scorer

    samples = play(NumberEnv, [3, 2], max_turns=2)
    assert len(samples) == 2
    assert [m["role"] for m in samples[0].messages] == ["assistant", "tool", "assistant"]
    assert samples[0].messages[1]["content"] == "=99"

    def last_turn_length(completions: list[Any], **kwargs: Any) -> list[float]:
        return [float(len([m for m in c if m["role"] == "assistant"][-1]["content"]))
                for c in completions]

    def whole_text(prompt: str, completion: str) -> float:
        return float("99" in completion)  # the plain-text form: observations included

    scorer = Scorer(lambda prompt, text: 0.0, UserRewards(specs=(
        async_rl_reward(last_turn_length), async_rl_reward(whole_text)), threads=True))
    scorer.start()
    try:
        scored = asyncio.run(scorer.score_trajectories(PROMPT, samples))
    finally:
        scorer.close()
    assert scored.scores == {"last_turn_length": (2.0, 2.0), "whole_text": (1.0, 1.0)}


def async_rl_reward(fn: Any) -> Any:
    import async_rl

    return async_rl.Reward(fn=fn)
