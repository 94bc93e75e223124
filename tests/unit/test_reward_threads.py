"""task.reward_threads = true with rewards that hang (issue 40, build item 4): a hung
thread cannot be killed, so once every reward thread is stuck past its deadline the pool
is saturated; calls are then refused at once and counted (``saturated``, a failure class
of its own) with one WARNING naming the keys, instead of each waiting out its timeout,
and the pool runs calls again once a stuck one returns. Real threads, a real reward
that blocks until the test lets it go."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator

import pytest

from workers.rewards.callables import Reward
from workers.rewards.guard import CallFailed
from workers.rewards.runner import GroupRewards, RewardRunner
from workers.rewards.threads import PoolSaturated, RewardThreads

TIMEOUT_S = 0.3


class Hanging:
    """A per-sample reward: 1.0, except that "hang" blocks until ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, prompt: str, completion: str) -> float:
        if completion == "hang":
            self.release.wait()
        return 1.0


@pytest.fixture
def hanging() -> Iterator[Hanging]:
    reward = Hanging()
    yield reward
    reward.release.set()  # no thread outlives the test


def score(runner: RewardRunner, completions: list[str]) -> tuple[GroupRewards, float]:
    began = time.monotonic()
    got = asyncio.run(runner.score(prompts=["p"] * len(completions), completions=completions,
                                   completion_ids=[[1]] * len(completions)))
    return got, time.monotonic() - began


def test_a_saturated_pool_refuses_at_once_counts_and_warns_once(
    hanging: Hanging, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="async_rl.rewards")
    with RewardRunner([hanging], threads=True, workers=2, timeout_s=TIMEOUT_S) as runner:
        hung, _ = score(runner, ["hang", "hang"])
        assert hung.timeouts == 2 and hung.saturated == 0
        for _ in range(2):
            refused, took = score(runner, ["ok", "ok", "ok"])
            assert refused.total == (0.0, 0.0, 0.0)
            assert refused.failed == (True, True, True)
            assert refused.timeouts == 3 and refused.saturated == 3
            assert took < TIMEOUT_S  # refused, not waited out
        warnings = [r.getMessage() for r in caplog.records
                    if "reward threads" in r.getMessage()]
        assert len(warnings) == 1
        assert "task.reward_workers" in warnings[0] and "task.reward_threads" in warnings[0]
        hanging.release.set()  # the stuck calls return: their threads are free again
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            again, _ = score(runner, ["ok", "ok"])
            if not again.saturated:
                break
            time.sleep(0.05)
        assert again.total == (1.0, 1.0) and again.timeouts == 0


def test_one_stuck_thread_of_two_is_no_saturation(hanging: Hanging) -> None:
    with RewardRunner([hanging], threads=True, workers=2, timeout_s=TIMEOUT_S) as runner:
        first, _ = score(runner, ["hang", "ok"])
        assert first.total == (0.0, 1.0)
        assert first.timeouts == 1 and first.saturated == 0
        second, _ = score(runner, ["ok", "ok"])
        assert second.total == (1.0, 1.0) and second.saturated == 0


def test_the_pool_counts_stuck_threads_until_their_calls_return(hanging: Hanging) -> None:
    threads = RewardThreads(workers=1, timeout_s=TIMEOUT_S)
    try:
        assert threads.stuck == 0 and not threads.saturated
        first = asyncio.run(threads.call(hanging, "p", "hang"))
        assert isinstance(first, CallFailed) and first.timed_out
        assert not isinstance(first, PoolSaturated)
        assert threads.stuck == 1 and threads.saturated
        refused = asyncio.run(threads.call(hanging, "p", "ok"))
        assert isinstance(refused, PoolSaturated) and refused.timed_out
        hanging.release.set()
        deadline = time.monotonic() + 5
        while threads.stuck and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threads.stuck == 0
        assert asyncio.run(threads.call(hanging, "p", "ok")) == 1.0
    finally:
        threads.close()


def test_a_call_that_finishes_in_time_leaves_no_thread_stuck(hanging: Hanging) -> None:
    threads = RewardThreads(workers=1, timeout_s=TIMEOUT_S)
    try:
        results = [asyncio.run(threads.call(hanging, "p", "ok")) for _ in range(3)]
        assert results == [1.0, 1.0, 1.0] and threads.stuck == 0
    finally:
        threads.close()


def test_saturation_reaches_the_run_summarys_failures(hanging: Hanging) -> None:
    """Scorer -> Group -> StepTotals: the failure class the summary and console show."""
    from async_rl.control.step_metrics import StepTotals
    from async_rl.run.summary import describe_failures
    from buffers.common.records import Prompt, Sample, make_group
    from workers.rewards.runner import UserRewards
    from workers.rollout.scoring import Scorer

    scorer = Scorer(lambda p, c: 0.0, UserRewards(specs=(Reward(fn=hanging),), threads=True,
                                                  workers=1, timeout_s=TIMEOUT_S))
    scorer.start()
    prompt = Prompt(prompt_id="p", text="1+1=", answer="2")
    totals = StepTotals()
    try:
        for texts in (["hang", "ok"], ["ok", "ok"]):
            samples = [Sample(token_ids=(1,), logprobs=(0.0,), versions=(0,),
                              finish_reason="stop", text=t) for t in texts]
            scored = asyncio.run(scorer.score(prompt, samples))
            totals.generated(make_group(prompt, [5], scored.samples,
                                        reward_timeouts=scored.timeouts,
                                        reward_pool_saturated=scored.saturated))
    finally:
        hanging.release.set()
        scorer.close()
    failures = totals.failures()
    # "hang" timed out and its thread stuck; the three calls after it were refused.
    assert failures["reward_timeouts"] == 4 and failures["reward_pool_saturated"] == 3
    assert "reward_pool_saturated 3" in describe_failures(failures)
    restored = StepTotals()
    restored.restore(totals.counters())
    assert restored.failures()["reward_pool_saturated"] == 3
