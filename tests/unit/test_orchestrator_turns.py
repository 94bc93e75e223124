"""The orchestrator with multi-turn groups from fake rollout workers (no Ray): a
trajectory whose turns span a weight update is counted from its oldest token, and
environment timeouts are counted, trained or re-queued (task.environment.on_timeout)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import anyio
import msgspec
import pytest
from orchestrator_fakes import (
    FakeRollout,
    FakeTrainer,
    config,
    ledger,
    run,
    trained_once_or_unfinished,
)

from buffers.common.records import NO_VERSION, Group, Prompt, Sample, make_group

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


class TurnsRollout(FakeRollout):
    """Two-turn trajectories: the first turn at the version the group started under, an
    observation, then the second turn after waiting (briefly) for a weight update; every
    5th group has one trajectory that timed out."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.started: dict[str, int] = {}
        self.timed_out: list[str] = []
        self.spanned = 0
        """Groups whose second turn ran under a newer version than their first."""

    async def generate(self, prompt: Prompt) -> Group:
        started = self.version_now
        self.started[f"{prompt.prompt_id}/{prompt.attempt}"] = started
        with anyio.move_on_after(0.05):
            while self.version_now == started:
                await anyio.sleep(0.002)
        later = self.version_now
        self.spanned += later > started
        self.generated += 1
        hang = self.generated % 5 == 0
        if hang:
            self.timed_out.append(prompt.prompt_id)
        samples = [Sample(token_ids=(5, 9, 6), logprobs=(-0.5, 0.0, -0.5),
                          versions=(started, NO_VERSION, later), finish_reason="stop",
                          text="x", reward=float(k % 2), loss_mask=(1, 0, 1),
                          env_outcome="timeout" if hang and k == 0 else "done")
                   for k in range(4)]
        return make_group(prompt, (1, 2), samples, rollout_rank=self.rank)


def env_config(tmp_path: Path, on_timeout: str) -> object:
    cfg = config(tmp_path, steps=6, max_staleness=1, groups=2)
    env = msgspec.structs.replace(cfg.task.environment,
                                  class_=f"{FIXTURES / 'adder_env.py'}:AdderEnv",
                                  on_timeout=on_timeout)
    return msgspec.structs.replace(cfg, task=msgspec.structs.replace(cfg.task,
                                                                       environment=env))


@pytest.mark.parametrize("on_timeout", ["train", "requeue"])
def test_a_trajectory_spanning_a_weight_update_counts_from_its_oldest_token(
        tmp_path: Path, on_timeout: str) -> None:
    cfg = env_config(tmp_path, on_timeout)
    rollout = TurnsRollout(0)
    summary = run(cfg, {0: rollout}, [FakeTrainer(0)])  # type: ignore[arg-type]
    assert summary.steps == 6
    events = ledger(tmp_path)
    counts = trained_once_or_unfinished(events)
    trained = [(pid, e) for pid, h in events.items() for e in h if e["event"] == "trained"]
    assert len(trained) == counts["trained"] == 12
    # Staleness of each trained group: trained version minus the version it started
    # under (its first turn's), never minus the newer version of its second turn.
    expected = Counter(int(e["version"]) - rollout.started[f"{pid}/{e['attempt']}"]
                       for pid, e in trained)
    assert Counter(dict(enumerate(summary.staleness_histogram))) + Counter() == expected
    assert max(expected) <= cfg.staleness.max_staleness
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert rollout.spanned  # some trajectories did span a weight update
    assert rollout.timed_out
    timeouts = summary.failures["env_timeouts"]
    assert timeouts == len(rollout.timed_out)
    requeued = {pid for pid, h in events.items() for e in h
                if (e["event"], e["reason"]) == ("dropped", "env_timeout")}
    if on_timeout == "requeue":
        assert requeued == set(rollout.timed_out)
        assert all(pid not in requeued or h[-1]["event"] in ("trained", "unfinished")
                   for pid, h in events.items())
    else:
        assert not requeued
