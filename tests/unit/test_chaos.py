"""bench/reliability/chaos.py's pure logic: the kill schedule, the ledger's lost and trained-twice
prompts, counting restarts in a run's output."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_modules import load_script

from buffers.common.reports import LedgerEntry

chaos = load_script("bench/reliability/chaos.py", "bench_chaos")


def test_schedule_is_reproducible_sorted_and_in_range() -> None:
    plan = chaos.plan_kills(seed=7, steps=80, kills=4, trainer_kill=True, checkpoint_every=10)
    assert plan == chaos.plan_kills(7, 80, 4, True, 10)
    assert plan != chaos.plan_kills(8, 80, 4, True, 10)
    assert [k.step for k in plan] == sorted(k.step for k in plan)
    (trainer,) = [k for k in plan if k.target == chaos.TRAINER]
    assert 26 <= trainer.step <= 53
    rollout = [k.step for k in plan if k.target == chaos.ROLLOUT]
    assert len(rollout) == len(set(rollout)) == 4 and trainer.step not in rollout
    assert all(2 <= s < 79 for s in rollout)
    assert all(0 <= k.delay_s <= 1.5 and 0 <= k.pick < 1 for k in plan)


def test_trainer_kill_comes_after_the_first_checkpoint() -> None:
    for seed in range(20):
        plan = chaos.plan_kills(seed, steps=30, kills=2, trainer_kill=True,
                                checkpoint_every=12)
        trainer = next(k.step for k in plan if k.target == chaos.TRAINER)
        assert 13 <= trainer <= 20
    with pytest.raises(ValueError, match="trainer kill"):
        chaos.plan_kills(0, steps=30, kills=2, trainer_kill=True, checkpoint_every=25)
    with pytest.raises(ValueError, match="trainer kill"):
        chaos.plan_kills(0, steps=30, kills=2, trainer_kill=True, checkpoint_every=0)
    assert all(k.target == chaos.ROLLOUT
               for k in chaos.plan_kills(0, 30, 3, trainer_kill=False, checkpoint_every=0))
    with pytest.raises(ValueError, match="do not fit"):
        chaos.plan_kills(0, steps=5, kills=4, trainer_kill=False, checkpoint_every=0)


def entry(prompt_id: str, event: str) -> LedgerEntry:
    return LedgerEntry(prompt_id=prompt_id, event=event, version=0)


def test_ledger_figures() -> None:
    events = [
        ("a", "admitted"), ("a", "generated"), ("a", "trained"),
        ("b", "admitted"), ("b", "failed"), ("b", "requeued"), ("b", "admitted"),
        ("b", "generated"), ("b", "trained"),
        ("c", "admitted"), ("c", "generated"), ("c", "unfinished"),
        ("d", "admitted"), ("d", "dropped"), ("d", "requeued"),  # never ran again: lost
        ("e", "admitted"), ("e", "trained"), ("e", "requeued"), ("e", "admitted"),
        ("e", "trained"),
        ("f", "admitted"),  # admitted, nothing more: lost
    ]
    figures = chaos.ledger_figures(entry(p, e) for p, e in events)
    assert figures.admitted == 6
    assert figures.trained == 4
    assert figures.unfinished == 1
    assert figures.lost == ["d", "f"]
    assert figures.trained_twice == ["e"]


def test_restarts_counted_from_the_runs_output() -> None:
    output = (
        "rollout-0 lost (RayActorError): restarting it (1 of 7 restarts)\n"
        "rollout-0 restarted at version 12\n"
        "rollout-1 lost (RayActorError): restarting it (2 of 7 restarts)\n"
        # Ray's log monitor prints a dead worker's message without its newline.
        "(raylet) A worker died ... and significant loss of progress by uninformed kernel "
        "OOM killing.rollout-1 lost (ActorDiedError): restarting it (3 of 7 restarts)\n"
    )
    assert chaos.restarts_in(output) == (3, 1)


def test_last_step_reads_the_newest_metrics_row(tmp_path: Path) -> None:
    assert chaos.last_step(tmp_path) == 0
    (tmp_path / "metrics.jsonl").write_text('{"step":1,"x":2}\n{"step":2,"x":3}\n')
    assert chaos.last_step(tmp_path) == 2
