"""Report outputs from stored spans: trace JSON opens, PNG is drawn, table names causes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from async_rl.analysis.idle import ROLLOUT_TRACK, TRAINER_TRACK
from async_rl.analysis.report import IDLE_JSON, TIMELINE, TRACE, RunIdle
from async_rl.cli import main
from async_rl.run.run_dir import SPANS, USAGE
from buffers.common.reports import UsageReading
from workers.common.spans import Span


def s(worker: str, role: str, cause: str, start: float, end: float, version: int = 0) -> Span:
    return Span(worker=worker, role=role, rank=int(worker[-1]) if worker[-1].isdigit() else 0,
                device="cpu:0", cause=cause, start=start, end=end, version=version)


def write_run(path: Path, trainer_wait: float) -> None:
    spans = [
        s("rollout-0", "rollout", "generate", 0, 8),
        s("rollout-0", "rollout", "weight_sync", 8, 9, version=1),
        s("rollout-0", "rollout", "idle", 9, 10, version=1),
        s("trainer-0", "trainer", "idle", 0, trainer_wait),
        s("trainer-0", "trainer", "forward", trainer_wait, 8),
        s("trainer-0", "trainer", "optimizer", 8, 8.5),
        s("trainer-0", "trainer", "idle", 8.5, 10, version=1),
        s(TRAINER_TRACK, "controller", "wait_data", 0, trainer_wait),
        s(TRAINER_TRACK, "controller", "training", trainer_wait, 8.5),
        s(TRAINER_TRACK, "controller", "weight_publish", 8.5, 9, version=1),
        s(TRAINER_TRACK, "controller", "wait_data", 9, 10, version=1),
        s(ROLLOUT_TRACK, "controller", "gate_closed", 9, 10, version=1),
    ]
    path.mkdir()
    (path / SPANS).write_bytes(b"".join(msgspec.json.encode(x) + b"\n" for x in spans))


def test_report_writes_trace_png_and_idle(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    write_run(run, trainer_wait=4)
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "wait_data" in out and "trainer waits for data" in out
    trace = msgspec.json.decode((run / TRACE).read_bytes())
    phases = {e["ph"] for e in trace["traceEvents"]}
    assert {"M", "X", "i", "s", "f"} <= phases  # tracks, spans, version marker, flow
    assert (run / TIMELINE).read_bytes()[:4] == b"\x89PNG"
    idle = msgspec.json.decode((run / IDLE_JSON).read_bytes(), type=RunIdle)
    trainer = next(w for w in idle.workers if w.role == "trainer")
    assert trainer.idle_by_cause["wait_data"] == pytest.approx(5.0)  # 0-4 and 9-10
    assert trainer.idle_by_cause["weight_publish"] == pytest.approx(0.5)
    rollout = next(w for w in idle.workers if w.role == "rollout")
    assert rollout.idle_by_cause["gate_closed"] == pytest.approx(1.0)
    assert rollout.idle_by_cause["weight_sync"] == pytest.approx(1.0)


def test_two_runs_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "a", trainer_wait=4)
    write_run(tmp_path / "b", trainer_wait=1)
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "trainer idle" in out and "55.0%" in out and "25.0%" in out


def test_report_of_a_non_run_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_timeline_hints_wrap_inside_the_image(tmp_path: Path) -> None:
    import matplotlib.image

    from async_rl.analysis.trace import write_timeline_png

    spans = [s("rollout-0", "rollout", "generate", 0, 8), s("trainer-0", "trainer", "idle", 0, 8)]
    hint = "trainer: trainer waits while its weights are published: " + "raise sync_every " * 20
    path = tmp_path / "t.png"
    write_timeline_png(spans, path, footer=f"{hint}\n{hint}")
    pixels = matplotlib.image.imread(path)
    # No text runs off the right edge: the last columns stay white from top to bottom.
    assert (pixels[:, -4:, :3] == 1.0).all()
    assert (pixels[-60:, :40, :3] < 1.0).any()  # the hints are drawn, bottom left


def test_cross_check_counts_weight_loads_as_cpu_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    write_run(run, trainer_wait=4)
    # Over the 10 s window the rollout worker generated 8 s and loaded weights 1 s (9 s
    # of CPU), the trainer computed 4.5 s and copied its snapshot 0.5 s (5 s).
    usage = {"rollout-0": {"first": UsageReading(wall=0.0, cpu_s=0.0),
                           "last": UsageReading(wall=10.0, cpu_s=9.0), "cores": 1.0},
             "trainer-0": {"first": UsageReading(wall=0.0, cpu_s=0.0),
                           "last": UsageReading(wall=10.0, cpu_s=5.0), "cores": 1.0}}
    (run / USAGE).write_bytes(msgspec.json.encode(usage))
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert ("cross-check rollout-0: spans say busy 80% (90% with weight loads and copies), "
            "OS CPU time says 90%") in out
    assert ("cross-check trainer-0: spans say busy 45% (50% with weight loads and copies), "
            "OS CPU time says 50%") in out
    check = msgspec.json.decode((run / IDLE_JSON).read_bytes(), type=RunIdle).cross_check
    assert check["rollout-0"]["span_computing"] == pytest.approx(0.9)
