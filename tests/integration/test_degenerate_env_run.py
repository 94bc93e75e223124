"""A real run on a user's worst day: real Ray, the real vLLM CPU build and the tiny
calculator model, with an environment (tests/fixtures/degenerate_calculator_env.py)
whose reset gives an over-long first prompt for about a quarter of the rows and raises on
about one call in eight.

The run finishes every step; both failures are counted by reason (excluded_env_too_long,
excluded_env_error); a group left without two members runs again at most
run.max_readmissions times and is then dropped for good (readmissions_exhausted); no
prompt is trained twice and none is recycled past the bound.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from test_async_grpo import check_ledger

from async_rl.config_io import load_config
from async_rl.run.run_dir import read_ledger, read_metrics
from async_rl.shell.ray_shell import run_training

pytestmark = pytest.mark.ray

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpu_tools.toml"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STEPS = 8
GROUPS = 4


def test_over_long_and_failing_resets_are_counted_and_never_wedge_a_run(
    calculator_model_dir: Path, tmp_path: Path, ray_shutdown: None,
) -> None:
    out = tmp_path / "run"
    config = load_config(EXAMPLE, {
        "model.path": str(calculator_model_dir), "run.output_dir": str(out),
        "run.num_steps": STEPS, "run.progress": False, "run.eval_every": 0,
        "task.eval_size": 0, "trainer.groups_per_step": GROUPS, "rollout.group_size": 4,
        "task.environment.class":
            f"{FIXTURES / 'degenerate_calculator_env.py'}:DegenerateCalculatorEnv",
        "task.environment.max_trajectory_tokens": 160})
    bound = config.run.max_readmissions

    summary = run_training(config)

    assert summary.stopped == "" and summary.steps == summary.final_version == STEPS
    failures = summary.failures
    assert failures["excluded_env_too_long"] > 0
    assert failures["excluded_env_error"] > 0 and failures["env_errors"] > 0
    # The over-long rows never get a member: each runs bound + 1 times, then gives up.
    assert failures["too_few_members"] >= failures["readmissions_exhausted"] * (bound + 1) > 0
    check_ledger(out, STEPS * GROUPS)
    attempts = Counter(e.prompt_id for e in read_ledger(out) if e.event == "admitted")
    assert len(attempts) > STEPS * GROUPS and max(attempts.values()) <= bound + 1
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["groups"] == GROUPS for r in rows)
    for r in rows:
        # Members and the excluded samples (counted apart, by reason) make up the groups.
        assert r["samples"] + r["samples_excluded"] == GROUPS * 4
        assert sum(r["excluded"].values()) == r["samples_excluded"]
        assert r["samples_trained"] == r["samples"]  # trainer.overlong keeps every member
        assert 0 < r["tokens_trained"] == r["tokens"]
    # Failed resets land in trained groups too: they are no member and train nothing.
    assert sum(r["samples_excluded"] for r in rows) > 0
