"""staleness.max_ahead in ``async-rl simulate``, which runs the real orchestrator and so
its admission gate: generation held closer to training drops fewer groups, trains
fresher ones and fewer a second (no Ray, no model: the model's size is given)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from async_rl.api import simulate
from async_rl.config import Config
from async_rl.run.run_dir import read_metrics
from async_rl.run.summary import RunSummary

SIZE = {"parameters": 4.0e6, "kv_bytes_per_token": 4096, "lengths": "lognormal",
        "length_median": 30.0, "length_sigma": 0.8}


def run(out: Path, max_ahead: int, *, wait_for_expiring: bool = False) -> RunSummary:
    """12 simulated steps of 8 groups at max_staleness 2; without wait_for_expiring a
    late group is dropped when it arrives, so drops show how far ahead generation ran."""
    config = msgspec.convert({
        "model": {"path": "not-needed"},
        "task": {"kind": "longtail", "eval_size": 8},
        "rollout": {"num_workers": 2, "group_size": 4, "max_new_tokens": 128,
                    "max_inflight_prompts": 8},
        "queue": {"max_groups": 32, "bucket_edges": [128, 512],
                  "wait_for_expiring": wait_for_expiring},
        "staleness": {"max_staleness": 2, "max_ahead": max_ahead},
        "trainer": {"num_shards": 2, "groups_per_step": 8, "micro_batch_tokens": 512},
        "run": {"num_steps": 12, "output_dir": str(out / f"ahead{max_ahead}"),
                "progress": False, "eval_every": 4},
        "simulate": SIZE,
    }, Config)
    summary = simulate(config)
    assert summary.steps == 12 and summary.groups_trained == 12 * 8
    rows = read_metrics(out / f"ahead{max_ahead}")
    assert len(rows) == 12 and all(row["staleness_max"] <= 2 for row in rows)
    return summary


def mean_staleness(summary: RunSummary) -> float:
    histogram = summary.staleness_histogram
    return sum(s * n for s, n in enumerate(histogram)) / sum(histogram)


def test_generation_held_closer_drops_less_trains_fresher_and_slower(tmp_path: Path) -> None:
    today, one, zero = (run(tmp_path, ahead) for ahead in (-1, 1, 0))
    # Today's setting (max_ahead = max_staleness) drops late groups; one version less
    # ahead leaves every late group a version to arrive in, and none is dropped.
    assert today.dropped_stale > 0 and one.dropped_stale == zero.dropped_stale == 0
    assert mean_staleness(today) > mean_staleness(one) > mean_staleness(zero) == 0.0
    assert zero.staleness_histogram == (96,)  # each group trained under its own version
    # The price: generation waits at the gate sooner, so fewer groups a second.
    assert today.groups_per_s > one.groups_per_s > zero.groups_per_s
    assert today.groups_generated > one.groups_generated >= zero.groups_generated == 96


@pytest.mark.parametrize("wait_for_expiring", [False, True])
def test_max_ahead_equal_to_max_staleness_is_the_default_run(
        tmp_path: Path, wait_for_expiring: bool) -> None:
    default = run(tmp_path / "default", -1, wait_for_expiring=wait_for_expiring)
    same = run(tmp_path / "same", 2, wait_for_expiring=wait_for_expiring)
    for field in ("wall_s", "staleness_histogram", "dropped_stale", "groups_generated"):
        assert getattr(default, field) == getattr(same, field), field
