"""The tuning benchmarks' arithmetic: the second half's groups/s of a run's metrics rows,
and the final's means, the trainer's seconds of a run (no runs: rows and records written
here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from async_rl.run.run_dir import METRICS
from bench.tuning.autopilot_vs_static import main as autopilot_vs_static
from bench.tuning.autopilot_vs_static import ratio, second_half
from bench.tuning.trainer_threads import idle_overlap, trainer_seconds
from bench.tuning.tune_vs_grid import Final
from workers.common.spans import Span


def _rows(run_dir: Path, rows: list[tuple[int, float]]) -> Path:
    """Steps 1..n, each (groups, seconds) split over wait, train and sync."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / METRICS).write_text("".join(
        json.dumps({"step": step, "groups": groups, "wait_s": seconds / 2,
                    "train_s": seconds / 4, "sync_s": seconds / 4}) + "\n"
        for step, (groups, seconds) in enumerate(rows, 1)))
    return run_dir


def test_the_second_half_is_the_steps_after_the_middle_over_their_seconds(
        tmp_path: Path) -> None:
    # Steps 1-2 at 1 group/s, steps 3-4 at 4 and 2 groups/s: (16 + 8) / (4 + 4) = 3.
    run_dir = _rows(tmp_path, [(4, 4.0), (4, 4.0), (16, 4.0), (8, 4.0)])
    assert second_half(run_dir) == pytest.approx(3.0)


def test_one_step_is_its_own_second_half_and_no_step_is_an_error(tmp_path: Path) -> None:
    assert second_half(_rows(tmp_path / "one", [(16, 2.0)])) == pytest.approx(8.0)
    assert second_half(_rows(tmp_path / "zero", [(16, 0.0)])) == 0.0
    with pytest.raises(SystemExit, match="logged no step"):
        second_half(_rows(tmp_path / "none", []))


def test_the_finals_means_skip_unknown_accuracies() -> None:
    final = Final(groups_per_s=(10.0, 14.0), accuracy=(0.8, None))
    assert final.mean_groups_per_s == 12.0 and final.mean_accuracy == 0.8
    assert Final(groups_per_s=(1.0,), accuracy=(None,)).mean_accuracy is None


def test_a_ratio_of_a_setup_that_did_not_run_is_not_available() -> None:
    means = {"poor+autopilot": 9.0, "tuned": 10.0}
    assert ratio(means, "poor+autopilot", "tuned") == "0.90"
    assert ratio(means, "tuned+autopilot", "grid best") == "n/a"
    assert ratio({"a": 1.0, "b": 0.0}, "a", "b") == "n/a"


def test_only_an_unknown_setup_is_refused_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        autopilot_vs_static(["--only", "poor"])
    assert exited.value.code == 2
    assert "--only: no setup 'poor'" in capsys.readouterr().err


def test_the_trainers_seconds_are_its_rows_train_and_wait(tmp_path: Path) -> None:
    # Each step's seconds split a half waiting, a quarter training: (4 + 8) / 4 and / 2.
    run_dir = _rows(tmp_path, [(4, 4.0), (4, 8.0)])
    assert trainer_seconds(run_dir) == pytest.approx((3.0, 6.0))
    assert trainer_seconds(_rows(tmp_path / "none", [])) == (0.0, 0.0)


def _span(worker: str, cause: str, start: float, end: float) -> Span:
    role = worker.split("-")[0]
    return Span(worker=worker, role=role, rank=0, device="cpu:0", cause=cause,
                start=start, end=end, version=0)


def test_the_overlap_is_the_engines_idle_time_while_the_trainer_computes() -> None:
    spans = [_span("rollout-0", "idle", 0.0, 2.0), _span("rollout-0", "generate", 2.0, 6.0),
             _span("rollout-0", "idle", 6.0, 9.0),
             _span("trainer-0", "forward", 1.0, 3.0), _span("trainer-0", "backward", 3.0, 7.0),
             _span("trainer-0", "idle", 7.0, 10.0), _span("controller", "training", 0.0, 9.0)]
    # Idle 0-2 and 6-9 (5 s); compute 1-7 (6 s); both 1-2 and 6-7.
    assert idle_overlap(spans) == pytest.approx((5.0, 6.0, 2.0))
    assert idle_overlap([]) == (0.0, 0.0, 0.0)
    # Two engines: a core is free only when both idle, which this does not measure.
    two = [*spans, _span("rollout-1", "generate", 0.0, 9.0)]
    assert idle_overlap(two)[0] == 0.0 and idle_overlap(two)[2] == 0.0
