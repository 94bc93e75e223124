"""The Python API in a real run: real Ray, the real vLLM CPU build and the tiny local
model, two steps.

``async_rl.train`` scores with callables defined in this module (a TRL-style one and an
``async def`` sample-style one), which reach the rollout worker and the idle-CPU
evaluator pickled by value (no worker can import this test module). ``async-rl train``
on a model named by hub id: ``test_stop_resume.py``'s SIGTERM run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_async_grpo import check_ledger, small_config

import async_rl
from async_rl.run.run_dir import read_metrics, read_summary

pytestmark = pytest.mark.ray

CONSTANT = 2.0
"""What ``constant`` scores."""
WEIGHT = 1.5
"""Its weight: WEIGHT * CONSTANT is above anything the built-in reward (0 or 1) gives."""


def digits(prompts: list[str], completions: list[str], **kwargs: object) -> list[float]:
    """TRL style: once per group."""
    assert len(prompts) == len(completions)
    return [1.0 if c.strip()[:1].isdigit() else 0.0 for c in completions]


async def constant(prompt: str, completion: str) -> float:
    """Sample style, async."""
    return CONSTANT


def test_train_scores_with_callables_in_training_and_evaluation(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None,
) -> None:
    out = tmp_path / "run"
    config = small_config(tiny_model_dir, out, max_staleness=1,
                          task={"eval_size": 4}, run={"num_steps": 2, "eval_on": "idle_cpu"})
    summary = async_rl.train(config, rewards=[digits, (constant, WEIGHT)])
    assert isinstance(summary, async_rl.RunSummary)
    assert summary.steps == 2 and summary.groups_trained == 2 * 4
    assert summary.failures.get("reward_errors", 0) == 0
    assert summary.failures.get("reward_timeouts", 0) == 0
    check_ledger(out, summary.groups_trained)
    # The evaluator scored with them too: the built-in reward gives at most 1.
    assert summary.accuracy_start is not None and summary.accuracy_end is not None
    assert summary.accuracy_start >= WEIGHT * CONSTANT > 1.0
    assert read_summary(out) == summary
    rows = read_metrics(out)
    assert len(rows) == 2
    for row in rows:
        assert 0.0 <= row["reward/digits"] <= 1.0
        assert row["reward/constant"] == CONSTANT
        assert row["reward_mean"] >= WEIGHT * CONSTANT
    with pytest.raises(async_rl.ConfigError, match="already holds a run"):
        async_rl.train(config, rewards=[digits])  # checked before anything starts
