"""examples/cpu_tools.toml itself, a few steps, on real Ray, the real vLLM CPU build and a
tiny calculator model.

The example's own config, with only what a test must change: the model (a short warm
start that calls the tool, see ``calculator_model_dir``), the output directory, three
steps, a small evaluation, and a tool latency whose heavy tail passes a tight
``turn_timeout_s`` now and then. The run finishes every step; the tool is called and
answers (observation tokens join the context but are not trained); the latency reaches
the environments of the rollout worker (``async_rl.tasks.table`` builds the built-in
``CalculatorEnv`` with ``task.tool_latency_ms``: calls past the time-out are counted as
``env_timeouts``, which an instant tool never has); no environment raises; and the
ledger shows every prompt trained once or accounted for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_async_grpo import check_ledger

from async_rl.config_io import load_config
from async_rl.run.run_dir import read_evals, read_metrics
from async_rl.shell.ray_shell import run_training
from async_rl.tasks.calculator import BUILT_IN_ENV, RESULT_CLOSE, RESULT_OPEN

pytestmark = pytest.mark.ray

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpu_tools.toml"
STEPS = 3
TOOL_LATENCY_MS = 100.0
TURN_TIMEOUT_S = 0.3
"""3x the median: about one tool call in seven draws a longer latency (sigma 1), and
the seeded stream of rollout worker 0 (task.seed 0) does so on its 5th call."""
SHORTEST_OBSERVATION = len(f"{RESULT_OPEN}error{RESULT_CLOSE}")
"""Tokens of the shortest observation (one byte a token)."""


def test_the_cpu_tools_example_calls_its_tool_and_trains_only_the_policy_tokens(
    calculator_model_dir: Path, tmp_path: Path, ray_shutdown: None,
) -> None:
    out = tmp_path / "run"
    config = load_config(EXAMPLE, {
        "model.path": str(calculator_model_dir), "run.output_dir": str(out),
        "run.num_steps": STEPS, "run.progress": False, "task.eval_size": 8,
        "task.tool_latency_ms": TOOL_LATENCY_MS,
        "task.environment.turn_timeout_s": TURN_TIMEOUT_S})
    assert config.task.kind == "calculator" and config.task.environment.class_ == BUILT_IN_ENV
    groups, group_size = config.trainer.groups_per_step, config.rollout.group_size

    summary = run_training(config)

    assert summary.stopped == "" and summary.steps == summary.final_version == STEPS
    assert summary.failures["env_errors"] == 0
    # The latency reached the environments: its tail passed the time-out. Most calls
    # still answered.
    assert 1 <= summary.failures["env_timeouts"] < STEPS * groups * group_size // 4
    check_ledger(out, STEPS * groups)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["groups"] == groups
        # Every token of a trajectory after its prompt, observations included, against
        # the loss's count: the tool answered, and its answers were not trained.
        completion = row["completion_tokens"]["mean"] * groups * group_size
        trained = sum(s["tokens"] for s in row["shards"])
        assert 0 < trained <= completion - SHORTEST_OBSERVATION
        assert 0.0 <= row["reward_mean"] <= 1.0
    evals = read_evals(out)
    assert [e.step for e in evals] == [0, STEPS]  # greedy multi-turn on the engine
    assert all(e.num_prompts == 8 for e in evals)
