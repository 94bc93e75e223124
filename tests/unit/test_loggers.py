"""run.loggers: metrics.jsonl always, and the TensorBoard event file and the W&B offline
run read back with their own readers; a logger whose package is missing is a config
error naming the key."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from async_rl.cli import main
from async_rl.config_io import decode_config
from async_rl.control.step_metrics import StepTotals
from async_rl.run.loggers import TENSORBOARD_DIR, scalars
from async_rl.run.run_dir import RunWriter, read_metrics
from async_rl.run.summary import EvalPoint


def row(step: int) -> dict[str, Any]:
    return {"step": step, "reward_mean": 0.25 * step, "nonfinite": False,
            "staleness_histogram": [1, 2], "queue": {"groups": 10 + step, "drops": 0},
            "completion_tokens": {}}


def write_run(out: Path, loggers: list[str]) -> list[dict[str, Any]]:
    """A run's records through RunWriter: three steps, one evaluation, the summary."""
    config = decode_config({"model": {"path": "m"},
                            "run": {"output_dir": str(out), "loggers": loggers}})
    writer = RunWriter(out, config)
    rows = [row(step) for step in (1, 2, 3)]
    for item in rows:
        writer.metrics(item)
    point = EvalPoint(step=2, version=2, version_min=2, accuracy=0.75, wall_s=1.5,
                      samples_trained=64, groups_trained=8, tokens_trained=512, eval_s=0.1,
                      num_prompts=4)
    writer.eval(point)
    totals = StepTotals()
    totals.groups_trained = 24
    writer.summary(totals.summary(wall_s=2.0, final_version=3, accuracy_start=0.5,
                                  accuracy_end=0.75, max_staleness=2, rollout_version=3,
                                  evals=[point]))
    writer.close()
    return rows


def test_scalars_flatten_numbers_and_leave_lists_out() -> None:
    assert scalars(row(2), "train") == {
        "train/step": 2.0, "train/reward_mean": 0.5, "train/nonfinite": 0.0,
        "train/queue/groups": 12.0, "train/queue/drops": 0.0,
    }


def test_jsonl_is_always_written(tmp_path: Path) -> None:
    rows = write_run(tmp_path / "run", ["jsonl"])
    assert read_metrics(tmp_path / "run") == rows
    assert not (tmp_path / "run" / TENSORBOARD_DIR).exists()


def test_tensorboard_event_file_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = write_run(tmp_path / "run", ["jsonl", "tensorboard"])
    assert read_metrics(tmp_path / "run") == rows  # still the source of truth
    events = EventAccumulator(str(tmp_path / "run" / TENSORBOARD_DIR))
    events.Reload()
    reward = events.Scalars("train/reward_mean")
    assert [(e.step, e.value) for e in reward] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("train/queue/groups")] == [
        (1, 11.0), (2, 12.0), (3, 13.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(2, 0.75)]
    assert events.Scalars("summary/groups_per_s")[0].value == pytest.approx(12.0)


def test_wandb_offline_run_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))  # nothing in $HOME
    write_run(tmp_path / "run", ["jsonl", "wandb"])
    (offline,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    # W&B's own reader of a run's transaction log: one JSON record per line.
    listing = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                              str(offline)], capture_output=True, text=True, check=True)
    records = [msgspec.json.decode(line) for line in listing.stdout.splitlines()]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    train = [(h["train/step"], h["train/reward_mean"]) for h in history if "train/step" in h]
    assert train == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(h["eval/version"], h["eval/accuracy"]) for h in history
            if "eval/accuracy" in h] == [(2, 0.75)]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "run"
    assert run["config"]["update"]["run"]["loggers"] == ["jsonl", "wandb"]
    summary = {k: v for r in records if r["type"] == "summary"
               for k, v in r["summary"].get("update", {}).items()}
    assert summary["summary/accuracy_end"] == 0.75
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]


def test_missing_logger_package_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    config = tmp_path / "c.toml"
    config.write_text('[model]\npath = "m"\n[run]\nloggers = ["jsonl", "wandb"]\n')
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("config error: run.loggers = ['jsonl', 'wandb']: 'wandb' needs")
    assert "async-rl[loggers]" in err
