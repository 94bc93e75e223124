"""Multi-turn rollouts with a user environment in a real run: real Ray, the real vLLM CPU
build and the tiny local model.

The environment is a file outside the package written to the public interface
(tests/fixtures/adder_env.py): two turns, an observation after the first. Its step
hangs forever on one trajectory in 20. The run finishes every step, the timeouts are
counted (env_timeouts), observation tokens are not trained, and the ledger shows no
prompt lost or trained twice, across a Ctrl-C and a resume too.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from test_async_grpo import check_ledger, small_config
from test_stop_resume import signal_after_rows, trained

from async_rl.control.checkpoint_files import latest_checkpoint
from async_rl.run.run_dir import read_metrics
from async_rl.shell.ray_shell import run_training

pytestmark = pytest.mark.ray

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_a_hanging_environment_never_wedges_a_run_across_ctrl_c_and_resume(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None,
) -> None:
    out = tmp_path / "run"
    config = small_config(tiny_model_dir, out, max_staleness=1, task={
        "eval_size": 0,
        "environment": {"class": f"{FIXTURES / 'adder_env.py'}:HangingAdderEnv",
                        "max_turns": 3, "stop": [";"], "turn_timeout_s": 0.3,
                        "max_trajectory_tokens": 96}},
        rollout={"prefix_caching": True})
    signal_after_rows(out, 3, signal.SIGINT, os.getpid())
    first = run_training(config)
    assert first.stopped == "SIGINT" and 3 <= first.steps < 6
    assert first.failures["env_timeouts"] >= 1  # each rollout process's 8th trajectory
    # The resumed run counts on from the checkpoint, not from the first run's summary
    # (that also counts groups still in flight at the Ctrl-C). Its own hanging
    # trajectory need not be counted: with one step left, the run can end while that
    # group is still waiting out its timeout.
    _, resumed_from = latest_checkpoint(out)
    second = run_training(config, resume=True)
    assert second.stopped == "" and second.final_version == 6
    assert second.failures["env_timeouts"] >= resumed_from.counters.env_timeouts >= 1
    counts = trained(out)
    assert len(counts) == 6 * 4 and set(counts.values()) == {1}
    check_ledger(out, 6 * 4)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for row in rows:
        # Trained tokens (the loss's count) leave out every prompt and observation token.
        trained_tokens = sum(s["tokens"] for s in row["shards"])
        completion = row["completion_tokens"]["mean"] * 4 * 4
        assert 0 < trained_tokens < completion
        assert 0.0 <= row["reward_mean"] <= 0.5  # at most 0.25 per step, two steps
