"""What ``[autopilot]`` had tuned survives a stop and resume, and the engines it added are
in the run's worker registry, without Ray: the engines a resumed run starts with
(``resumed_engines``: within the config's bounds, clamped with a line saying why), the
roster that starts them and marks them in the registry, the registry's printout and
report lines, the autopilot's state and its restore (a value off the ladder moves to
the nearest rung), and through the real orchestrator on in-process fakes: a run stopped
after the autopilot moved every live key resumes with each at its tuned value, applied
to the pool, the queue, the gate and the trainer rules, its changes still in run.json."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from orchestrator_fakes import FakeRollout, FakeTrainer, config, run

from async_rl.analysis.report import autopilot_lines
from async_rl.config import Config
from async_rl.config_io import decode_config
from async_rl.control import autopilot
from async_rl.control.autopilot import (
    ENGINES,
    INFLIGHT,
    MICRO_BATCH,
    QUEUE,
    STALENESS,
    Autopilot,
    Move,
    Window,
)
from async_rl.control.checkpoint_files import latest_checkpoint
from async_rl.control.orchestrator import Orchestrator
from async_rl.roster import (
    Start,
    registry_line,
    registry_table,
    resumed_engines,
    roster,
)
from async_rl.run.run_dir import read_metrics, read_record, read_workers
from async_rl.run.run_record import AutopilotChange, AutopilotState
from workers.layout import WorkerIdentity


def _engines(most: int, *, enabled: bool = True, workers: int = 1) -> Config:
    return decode_config({"model": {"path": "m"}, "rollout": {"num_workers": workers},
                          "autopilot": {"enabled": enabled, "max_rollout_workers": most}})


# ---- the engines a resumed run starts with -------------------------------------------------


@pytest.mark.parametrize(("saved", "expected"), [(0, 1), (1, 1), (2, 2), (3, 3)])
def test_a_resume_starts_with_the_engines_the_autopilot_had(saved: int, expected: int
                                                            ) -> None:
    assert resumed_engines(_engines(3), saved) == (expected, "")


def test_more_engines_than_the_resumed_config_allows_are_clamped_saying_why() -> None:
    count, why = resumed_engines(_engines(2), 4)
    assert count == 2
    assert why == ("the checkpoint ran 4 rollout engines (the autopilot's); "
                   "autopilot.max_rollout_workers = 2: the run resumes with 2")
    count, why = resumed_engines(_engines(3, enabled=False, workers=2), 3)
    assert count == 2 and "without autopilot.enabled" in why
    assert resumed_engines(_engines(-1, workers=2), 1) == (2, "")  # never below the config


def test_the_resumed_roster_starts_the_added_engines_and_marks_them() -> None:
    cores = (0, 1, 2, 3)
    start = Start(policy_path="ckpt/trainer", version=7)
    plan = roster(_engines(3), start, available=cores, engines=2)
    assert plan.resumed == 1 and [e.name for e in plan.lendable] == ["rollout-1", "rollout-2"]
    assert [e.name for e in plan.started] == [
        *(e.name for e in plan.entries), "rollout-1"]
    spec = plan.started[-1].spec
    assert spec.model.path == "ckpt/trainer"  # type: ignore[union-attr]
    placed = {e.name: e.identity(node="10.0.0.1", pid=100 + i)
              for i, e in enumerate(plan.started) if e.bundle is not None}
    registry = plan.registry(placed)
    assert [(w.name, w.added_after_step) for w in registry] == [
        ("rollout-0", -1), ("rollout-1", 7), ("trainer-0", -1)]
    assert plan.cpus == roster(_engines(3), available=cores).cpus  # room as before
    # None saved, more than room: none or every one of them.
    assert roster(_engines(3), start, available=cores).resumed == 0
    assert roster(_engines(3), start, available=cores, engines=9).resumed == 2


def test_the_registry_shows_when_the_autopilot_added_and_removed_an_engine() -> None:
    own = WorkerIdentity(role="trainer", rank=0, devices=(1,), node="n", pid=11)
    added = WorkerIdentity(role="rollout", rank=1, devices=(1,), node="n", pid=12,
                           added_after_step=3, removed_after_step=6)
    table = registry_table([own, added]).splitlines()
    assert len(table) == 3 and table[0].split()[-1] == "autopilot"
    assert table[1].split()[-1] == "-"
    assert table[2].endswith("added after step 3, removed after step 6")
    assert "autopilot" not in registry_table([own])  # a run without: as before
    assert registry_line(added) == ("rollout-1: node n, cpu:1, pid 12; added after step 3, "
                                    "removed after step 6")
    assert registry_line(own).endswith("a worker of the run")


def test_report_lists_the_added_engines_after_the_changes() -> None:
    record: Any = msgspec.structs.replace(
        _record(), autopilot=(AutopilotChange(step=3, key=ENGINES, old=1, new=2,
                                              cause="starved"),))
    engine = WorkerIdentity(role="rollout", rank=1, pid=12, added_after_step=3)
    lines = autopilot_lines(record, [engine])
    assert len(lines) == 4 and lines[2] == "engines the autopilot added (1, workers.json):"
    assert lines[3] == "  rollout-1: node -, cpu:-, pid 12; added after step 3"
    assert autopilot_lines(record, []) == lines[:2]
    assert autopilot_lines(None, []) == []


def _record() -> Any:
    from async_rl.run.run_record import collect
    return collect(_engines(3), argv=["x"])


# ---- the autopilot's state -----------------------------------------------------------------


def _pilot() -> Autopilot:
    return Autopilot(decode_config({
        "model": {"path": "m"}, "rollout": {"max_inflight_prompts": 4},
        "queue": {"max_groups": 64}, "staleness": {"max_staleness": 2},
        "autopilot": {"enabled": True}}))


def test_the_autopilot_resumes_its_values_and_changes() -> None:
    pilot = _pilot()
    change = AutopilotChange(step=5, key=INFLIGHT, old=4, new=8, cause="c", outcome="kept")
    saved = AutopilotState(values={INFLIGHT: 8, QUEUE: 128, STALENESS: 1, MICRO_BATCH: 2048,
                                   "gone.key": 3}, changes=(change,))
    assert pilot.restore(saved, engines=1) == []
    assert pilot.values == {INFLIGHT: 8, QUEUE: 128, STALENESS: 1, MICRO_BATCH: 2048}
    assert pilot.changes == [change] and pilot.state().changes == (change,)
    assert msgspec.json.decode(msgspec.json.encode(pilot.state()), type=AutopilotState) \
        == pilot.state()


def test_a_value_outside_the_resumed_range_moves_to_the_nearest_rung_saying_so() -> None:
    pilot = _pilot()
    lines = pilot.restore(AutopilotState(values={INFLIGHT: 1000, QUEUE: 100}), engines=1)
    assert pilot.values[INFLIGHT] == pilot.rungs[INFLIGHT][-1] == 64
    assert pilot.values[QUEUE] == 128  # between 64 and 128: the nearer
    assert len(lines) == 2 and lines[0].startswith(
        f"autopilot: {INFLIGHT} was 1000 at the checkpoint, outside its range here "
        "(1..64): it resumes at 64")
    assert pilot.restore(AutopilotState(values={}), engines=1) == []  # none saved: as is


# ---- through the orchestrator: stop, resume ------------------------------------------------


def _scripted(keys: list[str]) -> Callable[[Autopilot, Window], Move | None]:
    """Each window moves the next of ``keys`` one rung (up, or down when it is at the
    top), then nothing."""
    def decide(self: Autopilot, window: Window) -> Move | None:
        moved = len(self.changes)
        if moved >= len(keys):
            return None
        key = keys[moved]
        rungs, value = self.rungs[key], self.values[key]
        new = next((r for r in rungs if r > value), None) or max(r for r in rungs if r < value)
        return Move(key=key, old=value, new=new, cause="scripted")
    return decide


def test_a_resumed_run_goes_on_at_the_tuned_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [INFLIGHT, QUEUE, MICRO_BATCH, STALENESS]
    base = config(tmp_path, steps=8, max_staleness=2)
    cfg = msgspec.structs.replace(base, autopilot=msgspec.structs.replace(
        base.autopilot, enabled=True, every_steps=1, keys=tuple(keys)))
    monkeypatch.setattr(Autopilot, "_decide", _scripted(keys))
    monkeypatch.setattr(autopilot, "noise_band", lambda before, after: float("inf"))
    run(cfg, {0: FakeRollout(0)}, [FakeTrainer(0)], stop_after=5)

    # Steps 2-5 made four windows: a move each, the last pending at the stop.
    _, saved = latest_checkpoint(tmp_path)
    assert saved.autopilot is not None
    moves = [(c.key, c.old, c.new, c.outcome) for c in saved.autopilot.changes]
    assert [m[0] for m in moves] == keys and [m[3] for m in moves] == ["kept"] * 3 + [
        "pending"]
    tuned = {key: new for key, _, new, _ in moves}
    assert saved.autopilot.values == tuned
    assert tuned != {key: old for key, old, _, _ in moves}

    applied: dict[str, int] = {}

    async def read(orchestrator: Orchestrator) -> None:  # before the first resumed step
        applied.update({INFLIGHT: orchestrator.pool.limit,
                        QUEUE: orchestrator.queue.max_groups,
                        MICRO_BATCH: orchestrator.tuning.trainer.micro_batch_tokens,
                        STALENESS: orchestrator.gate.max_staleness})

    monkeypatch.setattr(Autopilot, "_decide", lambda self, window: None)
    run(cfg, {0: FakeRollout(0)}, [FakeTrainer(0)], resume=True, beside=read)
    assert applied == tuned
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == list(range(1, 9))
    resumed = [row for row in rows if row["step"] > saved.step]
    assert len(resumed) == 8 - saved.step
    assert all(row[f"autopilot/{key}"] == value
               for row in resumed for key, value in tuned.items()), resumed
    record = read_record(tmp_path)
    assert record is not None and [c.key for c in record.autopilot] == keys
    assert read_workers(tmp_path) == []  # the fakes write no registry


def test_a_run_without_the_autopilot_keeps_no_state(tmp_path: Path) -> None:
    run(config(tmp_path, steps=3), {0: FakeRollout(0)}, [FakeTrainer(0)])
    _, saved = latest_checkpoint(tmp_path)
    assert saved.autopilot is None
