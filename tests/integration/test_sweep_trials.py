"""`async-rl sweep` end to end: each trial a real `async-rl train` process (its own Ray and
vLLM CPU engine) on the tiny model, given its own value; a bad value fails its trial
only; a rerun skips the finished trials. Each trial's console stays quiet and its
workers.log holds the rest. One good value and one bad: each good one is a Ray and
vLLM start, most of a trial's time here."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from async_rl.analysis.sweep import CONSOLE_LOG, SWEEP_CSV, SWEEP_PNG, parse_grid, run_sweep
from async_rl.run.run_dir import RUN_RECORD, WORKERS_LOG, read_record, read_summary

pytestmark = pytest.mark.ray


def write_config(tiny_model_dir: Path, tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(f"""
[model]
path = "{tiny_model_dir}"
[task]
eval_size = 8
[rollout]
group_size = 4
max_new_tokens = 6
max_inflight_prompts = 8
[queue]
max_groups = 32
[trainer]
groups_per_step = 4
micro_batch_tokens = 512
[run]
progress = false
output_dir = "{tmp_path / 'unused'}"
""")
    return path


def test_sweep_runs_each_trial_records_a_failure_and_skips_on_rerun(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None
) -> None:
    config = write_config(tiny_model_dir, tmp_path)
    out = tmp_path / "sweep"
    grid = parse_grid(["staleness.max_staleness=1,-1"])
    results = run_sweep(str(config), grid, out=out, steps=3)
    assert [r.status for r in results] == ["done", "failed"], results
    assert "staleness.max_staleness = -1" in results[1].error
    for result in results[:1]:
        summary = read_summary(result.run_dir)
        assert summary.steps == 3 and summary.groups_per_s > 0
        record = read_record(result.run_dir)
        assert record is not None and record.ended is not None
        assert summary.max_staleness == 1  # its own value, not the default (2)
        assert "staleness.max_staleness=1" in record.command
        # The quiet console: vLLM's INFO lines are in workers.log, not on the console.
        console = (result.run_dir / CONSOLE_LOG).read_text()
        workers = (result.run_dir / WORKERS_LOG).read_text()
        assert " INFO " not in console and len(console.splitlines()) < 60
        assert " INFO " in workers and "RolloutActor pid=" in workers
    with open(out / SWEEP_CSV) as table:
        rows = list(csv.DictReader(table))
    assert [(r["staleness.max_staleness"], r["status"]) for r in rows] == [
        ("1", "done"), ("-1", "failed")]
    assert float(rows[0]["groups_per_s"]) > 0 and rows[0]["trainer_top_cause"]
    assert 0 <= float(rows[0]["accuracy_end"]) <= 1
    assert (out / SWEEP_PNG).read_bytes()[:4] == b"\x89PNG"

    stamp = (results[0].run_dir / RUN_RECORD).stat().st_mtime_ns
    again = run_sweep(str(config), grid, out=out, steps=3)
    assert [r.status for r in again] == ["finished_earlier", "failed"]
    assert (again[0].run_dir / RUN_RECORD).stat().st_mtime_ns == stamp
