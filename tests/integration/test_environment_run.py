"""Multi-turn rollouts with a user environment, and calls that never return, in a real run
across a Ctrl-C and a resume: real Ray, the real vLLM CPU build and the tiny local model.

The environment is a file outside the package written to the public interface
(tests/fixtures/adder_env.py): two turns, an observation after the first. Its step
hangs forever on one trajectory in 20. The task's own reward (task.rewards, a file
outside the package) never returns on one call in 50. One run stopped by SIGINT mid-way
and resumed has both: every step finishes, the environment's and the reward's timeouts
are counted (env_timeouts, reward_timeouts), observation tokens are not trained, and the
ledger shows no prompt lost or trained twice over the two halves. The one run serves
both tests (``stopped_and_resumed``): a Ray and vLLM start is most of a run's time here.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from test_async_grpo import check_ledger, small_config
from test_stop_resume import check_restored, signal_after_rows, trained

from async_rl.control.checkpoint_files import RunState, latest_checkpoint
from async_rl.run.run_dir import read_metrics
from async_rl.run.summary import RunSummary
from async_rl.shell.ray_shell import run_training

pytestmark = pytest.mark.ray

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

HANGS_ONE_CALL_IN_50 = '''
import fcntl
import time
from pathlib import Path

CALLS = Path(__file__).with_name("calls.txt")


def hangs_one_in_50(prompt, completion, answer):
    """Per-sample style; calls 7, 57, 107, ... (counted across the reward processes in
    a file) never return; the others score 0 (the environment's reward is the one
    under test)."""
    with CALLS.open("a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        calls = len(handle.read()) + 1
        handle.write("x")
    if calls % 50 == 7:
        time.sleep(3600)
    return 0.0
'''


class StoppedAndResumed(NamedTuple):
    """The run stopped by SIGINT and resumed, read after both halves."""

    out: Path
    first: RunSummary
    second: RunSummary
    resumed_from: RunState
    """The checkpoint the second half resumed from."""
    rows: list[dict[str, Any]]


@pytest.fixture(scope="module")
def stopped_and_resumed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                        ray_shutdown_module: None) -> StoppedAndResumed:
    """6 steps with the hanging environment and the hanging reward, SIGINT once 3 are
    logged, then ``resume``."""
    tmp = tmp_path_factory.mktemp("hangs")
    rewards = tmp / "hanging.py"
    rewards.write_text(HANGS_ONE_CALL_IN_50)
    out = tmp / "run"
    config = small_config(tiny_model_dir, out, max_staleness=1, task={
        "eval_size": 0,
        "environment": {"class": f"{FIXTURES / 'adder_env.py'}:HangingAdderEnv",
                        "max_turns": 3, "stop": [";"], "turn_timeout_s": 0.3,
                        "max_trajectory_tokens": 96},
        "reward_timeout_s": 1.0, "reward_workers": 2,
        "rewards": [{"function": f"{rewards}:hangs_one_in_50"}]},
        rollout={"prefix_caching": True})
    signal_after_rows(out, 3, signal.SIGINT, os.getpid())
    first = run_training(config)
    _, resumed_from = latest_checkpoint(out)
    (tmp / "calls.txt").unlink()  # the resumed half hangs on its 7th call again
    second = run_training(config, resume=True)
    return StoppedAndResumed(out=out, first=first, second=second, resumed_from=resumed_from,
                             rows=read_metrics(out))


def test_a_hanging_environment_never_wedges_a_run_across_ctrl_c_and_resume(
    stopped_and_resumed: StoppedAndResumed,
) -> None:
    run = stopped_and_resumed
    assert run.first.stopped == "SIGINT" and 3 <= run.first.steps < 6
    assert run.first.failures["env_timeouts"] >= 1  # each rollout process's 8th trajectory
    # The resumed run counts on from the checkpoint, not from the first run's summary
    # (that also counts groups still in flight at the Ctrl-C). Its own hanging
    # trajectory need not be counted: with one step left, the run can end while that
    # group is still waiting out its timeout.
    assert run.second.stopped == "" and run.second.final_version == 6
    assert run.second.failures["env_timeouts"] >= run.resumed_from.counters.env_timeouts >= 1
    counts = trained(run.out)
    assert len(counts) == 6 * 4 and set(counts.values()) == {1}
    check_ledger(run.out, 6 * 4)
    # At max_staleness 1 the stop's queue holds groups of the next steps: kept, and
    # trained after the resume as they were generated.
    kept = check_restored(run.out, run.resumed_from)
    print(f"queued groups kept by the stop: {len(kept)}")
    assert [r["step"] for r in run.rows] == list(range(1, 7))
    for row in run.rows:
        # Trained tokens (the loss's count) leave out every prompt and observation token.
        trained_tokens = sum(s["tokens"] for s in row["shards"])
        completion = row["completion_tokens"]["mean"] * 4 * 4
        assert 0 < trained_tokens < completion
        assert 0.0 <= row["reward_mean"] <= 0.5  # at most 0.25 per step, two steps


def test_a_reward_hanging_on_one_call_in_50_across_ctrl_c_and_resume(
    stopped_and_resumed: StoppedAndResumed,
) -> None:
    """Both halves lose only the hung scores; every prompt is trained exactly once over
    the two (the ledger's checks: the test above, on the same run)."""
    run = stopped_and_resumed
    assert run.first.stopped == "SIGINT" and run.first.failures["reward_timeouts"] >= 1
    assert run.second.stopped == "" and run.second.final_version == 6
    assert run.second.failures["reward_timeouts"] >= 1
    assert [r["step"] for r in run.rows] == list(range(1, 7))
    # The reward's own mean, over the members it scored (none once both its processes
    # are stuck).
    assert any("reward/hangs_one_in_50" in row for row in run.rows)
    assert all(row.get("reward/hangs_one_in_50", 0.0) == 0.0 for row in run.rows)
