"""Sweeps without training: grid parsing and trial naming, a failed trial recorded while the
sweep goes on, a finished trial skipped, and sweep.csv, the table and sweep.png."""

from __future__ import annotations

import csv
from pathlib import Path

import msgspec
import pytest
from hub_cache import add_to_hub_cache
from huggingface_hub import constants

from async_rl.analysis.idle import Breakdown
from async_rl.analysis.report import IDLE_JSON, RunIdle
from async_rl.analysis.sweep import (
    SWEEP_CSV,
    SWEEP_PNG,
    finished,
    parse_grid,
    run_trial,
    split_values,
    trials,
)
from async_rl.cli import main
from async_rl.config_io import load_config, to_toml
from async_rl.control.step_metrics import StepTotals
from async_rl.run.run_dir import CONFIG, SUMMARY
from buffers.common.config import ConfigError


def test_values_split_at_commas_outside_brackets() -> None:
    assert split_values("0,1, 2") == ["0", "1", "2"]
    assert split_values("[64,128],[32, 64]") == ["[64,128]", "[32, 64]"]


def test_grid_parses_and_names_every_combination() -> None:
    grid = parse_grid(["staleness.max_staleness=0,2", "queue.bucket_edges=[64,128],[32]"])
    assert grid == {"staleness.max_staleness": ("0", "2"),
                    "queue.bucket_edges": ("[64,128]", "[32]")}
    planned = trials(grid, repeat=2)
    assert len(planned) == 8
    assert planned[0].values == (("staleness.max_staleness", "0"),
                                 ("queue.bucket_edges", "[64,128]"))
    assert planned[0].name == "staleness.max_staleness=0__queue.bucket_edges=_64_128_"
    assert planned[1].name == planned[0].name + "-r1" and planned[1].repeat == 1
    assert planned[-1].values[0] == ("staleness.max_staleness", "2")  # first key slowest
    assert len({t.name for t in planned}) == 8


@pytest.mark.parametrize(("items", "message"), [
    (["staleness.max_staleness"], "expected section.key=v1,v2"),
    (["staleness.max_staleness=0,,1"], "expected section.key=v1,v2"),
    (["staleness.colour=0,1"], "staleness.colour"),
    (["run.seed=0", "run.seed=1"], "given twice"),
])
def test_bad_grid_is_one_line(items: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_grid(items)


def write_config(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    path = tmp_path / "c.toml"
    path.write_text(f'[model]\npath = "{model}"\n[run]\noutput_dir = "{tmp_path / "runs"}"\n')
    return path


def fake_finished_run(run_dir: Path, config_path: Path, overrides: list[str],
                      stopped: str = "") -> None:
    """What `async-rl train` leaves: the resolved config, summary.json and idle.json."""
    run_dir.mkdir(parents=True)
    config = load_config(config_path, [*overrides, f'run.output_dir="{run_dir}"'])
    (run_dir / CONFIG).write_text(to_toml(config))
    totals = StepTotals()
    totals.groups_trained = 80
    totals.staleness.update([0, 1, 1, 2])
    totals.dropped_stale = 3
    summary = totals.summary(wall_s=4.0, final_version=5, accuracy_start=0.25,
                             accuracy_end=0.5, max_staleness=2, rollout_version=5,
                             stopped=stopped)
    (run_dir / SUMMARY).write_bytes(msgspec.json.encode(summary))
    roles = (Breakdown(name="trainer", role="trainer", device="1 device(s)", wall_s=4.0,
                       busy_s=3.0, idle_by_cause={"wait_data": 0.75, "no_work": 0.25}),
             Breakdown(name="rollout", role="rollout", device="1 device(s)", wall_s=4.0,
                       busy_s=4.0, idle_by_cause={"gate_closed": 0.0}))
    idle = RunIdle(start=0.0, end=4.0, workers=roles, roles=roles)
    (run_dir / IDLE_JSON).write_bytes(msgspec.json.encode(idle))


def test_finished_needs_the_same_resolved_config(tmp_path: Path) -> None:
    config_path = write_config(tmp_path)
    run_dir = tmp_path / "t"
    fake_finished_run(run_dir, config_path, ["staleness.max_staleness=1"])
    same = load_config(config_path, ["staleness.max_staleness=1", f'run.output_dir="{run_dir}"'])
    assert finished(run_dir, same)
    assert not finished(run_dir, msgspec.structs.replace(same, staleness=msgspec.structs.replace(
        same.staleness, max_staleness=2)))
    (run_dir / SUMMARY).unlink()
    assert not finished(run_dir, same)  # crashed or interrupted: run again


def test_a_trial_stopped_by_a_signal_or_failed_is_not_finished(tmp_path: Path) -> None:
    config_path = write_config(tmp_path)
    for stopped in ("SIGTERM", "failed: the trainer shard died"):
        run_dir = tmp_path / stopped.split(":")[0]
        fake_finished_run(run_dir, config_path, [], stopped=stopped)
        assert (run_dir / SUMMARY).exists()
        assert not finished(run_dir, load_config(config_path, [f'run.output_dir="{run_dir}"']))


def test_sweep_records_a_failed_trial_and_skips_a_finished_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = write_config(tmp_path)
    out = tmp_path / "sweep"
    fake_finished_run(out / "staleness.max_staleness=1", config_path,
                      ["staleness.max_staleness=1"])
    assert main(["sweep", str(config_path), "--grid", "staleness.max_staleness=-1,1",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[1/2] staleness.max_staleness = -1: FAILED (config error: " in printed
    assert "[2/2] staleness.max_staleness = 1: finished earlier, skipped" in printed
    with open(out / SWEEP_CSV) as table:
        rows = list(csv.DictReader(table))
    assert [(r["staleness.max_staleness"], r["status"]) for r in rows] == [
        ("-1", "failed"), ("1", "finished_earlier")]
    assert rows[0]["error"] == "config error: staleness.max_staleness = -1: expected `int` >= 0"
    assert rows[0]["groups_per_s"] == ""
    done = rows[1]
    assert float(done["groups_per_s"]) == pytest.approx(20.0)
    assert float(done["staleness_mean"]) == pytest.approx(1.0)
    assert done["dropped_stale"] == "3" and done["accuracy_end"] == "0.5"
    assert float(done["trainer_idle"]) == pytest.approx(0.25)
    assert done["trainer_top_cause"] == "wait_data" and done["rollout_top_cause"] == ""
    assert done["time_to_target_s"] == ""
    assert "25% wait_data" in printed and "20.00" in printed and "not reached" in printed
    assert "failed: staleness.max_staleness=-1: config error: " in printed
    assert (out / SWEEP_PNG).read_bytes()[:4] == b"\x89PNG"


def test_a_trial_on_a_hub_id_is_skipped_once_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its run directory records the snapshot directory, the config it was run from a
    hub id: the trial compares them resolved."""
    hub = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = add_to_hub_cache(hub, "org/tiny", files={"config.json": '{"model_type": "qwen2"}'})
    config_path = tmp_path / "c.toml"
    config_path.write_text('[model]\npath = "org/tiny"\n')
    run_dir = tmp_path / "sweep" / "run.seed=1"
    fake_finished_run(run_dir, config_path, [f'model.path="{snapshot}"', "run.seed=1"])
    trial = trials(parse_grid(["run.seed=1"]), repeat=1)[0]
    result = run_trial(str(config_path), trial, run_dir, [], steps=None)
    assert result.status == "finished_earlier"


def test_sweep_default_out_is_next_to_the_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = write_config(tmp_path)
    assert main(["sweep", str(config_path), "--grid", "run.seed=-5"]) == 0
    assert (tmp_path / "runs-sweep" / SWEEP_CSV).exists()
    assert "FAILED" in capsys.readouterr().out
