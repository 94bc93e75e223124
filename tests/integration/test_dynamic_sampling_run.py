"""DAPO's dynamic sampling and over-long mask in a real run: real Ray, the real vLLM CPU
build and the small learnable model (base accuracy about 0.2, so many groups of four
samples are all wrong: no signal).

With rollout.filter_groups = "zero_variance" every trained group has reward variance
> 0, the filtered groups are counted in the summary and the ledger, fresh prompts fill
every step, and no prompt is lost or trained twice; trainer.overlong = "mask" trains
the same run with its truncated completions left out of the loss.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from test_async_grpo import check_ledger, small_config

from async_rl.run.run_dir import read_ledger, read_metrics
from async_rl.shell.ray_shell import run_training

pytestmark = pytest.mark.ray

STEPS = 4
GROUPS_PER_STEP = 4


def test_zero_variance_groups_are_filtered_and_every_trained_group_has_signal(
    learnable_model_dir: Path, tmp_path: Path, ray_shutdown: None,
) -> None:
    out = tmp_path / "run"
    config = small_config(learnable_model_dir, out, max_staleness=1,
                          rollout={"filter_groups": "zero_variance"},
                          trainer={"overlong": "mask"}, run={"num_steps": STEPS})
    summary = run_training(config)

    assert summary.steps == STEPS and not summary.stopped
    assert summary.groups_trained == STEPS * GROUPS_PER_STEP
    assert summary.filtered_groups > 0  # at accuracy ~0.2, ~40% of groups are all wrong
    assert summary.groups_generated >= summary.groups_trained + summary.filtered_groups
    check_ledger(out, summary.groups_trained, summary.filtered_groups)

    entries = read_ledger(out)
    trained = [e for e in entries if e.event == "trained"]
    filtered = [e for e in entries if (e.event, e.reason) == ("dropped", "filtered")]
    assert len(trained) == summary.groups_trained
    assert len(filtered) == summary.filtered_groups
    assert all(len(e.rewards) == 4 and statistics.pvariance(e.rewards) > 0 for e in trained)
    assert all(statistics.pvariance(e.rewards) == 0 for e in filtered)

    rows = read_metrics(out)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert any(row["filtered_fraction"] > 0 for row in rows)
    assert all(0.0 <= row["filtered_fraction"] <= 1.0 for row in rows)
    assert all(0.0 <= row["truncated_fraction"] <= 1.0 for row in rows)
