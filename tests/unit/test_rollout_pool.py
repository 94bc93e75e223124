"""RolloutPool picks the least-busy live worker, ties to the earliest in its map's order
(a restarted worker last), as a scan with min() over the map does; a replacement that
fails to start is a failed restart, replaced again; one that hangs cannot hold up the
pool's exit past its deadline."""

from __future__ import annotations

import logging
import random
import time
from typing import cast

import anyio
import pytest

from async_rl.control.failures import RolloutFailed
from async_rl.control.protocols import RolloutClient
from async_rl.control.rollout_pool import RolloutPool
from async_rl.control.step_metrics import StepTotals


def _min_scan(live: dict[int, object], busy: dict[int, int]) -> int:
    return min(live, key=busy.__getitem__)


def test_the_least_busy_pick_matches_a_scan_through_releases_retires_and_restarts() -> None:
    async def restart(rank: int, model_dir: str, version: int) -> RolloutClient:
        return cast(RolloutClient, object())

    async def current_policy(rank: int) -> tuple[str, int]:
        return "", 0

    async def main() -> None:
        workers = {rank: cast(RolloutClient, object()) for rank in range(6)}
        pool = RolloutPool(workers, limit=3, max_restarts=10**6, totals=StepTotals(),
                           restart=restart, current_policy=current_policy, exit_wait_s=1.0)
        busy = dict.fromkeys(workers, 0)  # the reference, kept by hand
        held: list[int] = []
        rng = random.Random(7)
        async with pool.replacing():
            for _ in range(3000):
                live = pool.workers
                roll = rng.random()
                if roll < 0.5 and not pool.full():
                    expected = _min_scan(live, busy)
                    rank, worker = await pool.acquire(lambda: None)
                    assert (rank, worker) == (expected, live[expected])
                    busy[rank] += 1
                    held.append(rank)
                elif roll < 0.95 and held:
                    rank = held.pop(rng.randrange(len(held)))
                    await pool.release(rank)  # a lost worker's calls give theirs back too
                    busy[rank] -= 1
                else:  # lost, and restarted last in the map's order
                    rank = rng.choice(list(live))
                    pool.retire(rank, live[rank], "test")
                    await anyio.wait_all_tasks_blocked()
                    assert list(pool.workers)[-1] == rank
                assert pool.full() == (min(busy[r] for r in pool.workers) >= pool.limit)

    anyio.run(main)


async def _current_policy(rank: int) -> tuple[str, int]:
    return "", 0


def test_a_replacement_that_never_starts_does_not_hold_up_the_pools_exit(
        caplog: pytest.LogCaptureFixture) -> None:
    started: list[int] = []

    async def hangs(rank: int, model_dir: str, version: int) -> RolloutClient:
        started.append(rank)
        await anyio.sleep_forever()  # its engine's start never returns
        raise AssertionError

    async def main() -> float:
        lost = cast(RolloutClient, object())
        totals = StepTotals()
        pool = RolloutPool({0: lost, 1: cast(RolloutClient, object())}, limit=1,
                           max_restarts=3, totals=totals, restart=hangs,
                           current_policy=_current_policy, exit_wait_s=0.2)
        with anyio.fail_after(10):  # never on the pool's own
            async with pool.replacing():
                pool.retire(0, lost, "dead")
                await anyio.wait_all_tasks_blocked()
                assert started == [0]
                began = time.monotonic()
        assert (totals.restarts, totals.failed_restarts) == (1, 1)
        assert sorted(pool.workers) == [1]
        assert totals.failures()["failed_restarts"] == 1
        return time.monotonic() - began

    with caplog.at_level(logging.WARNING, logger="async_rl.control.rollout_pool"):
        waited = anyio.run(main)
    assert 0.2 <= waited < 2.0
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("rollout-0: its restart was cancelled, still under way 0.2 s after the "
                    "run ended (run.call_timeout_s)")


def test_a_replacement_that_fails_to_start_is_replaced_again_while_restarts_are_left() -> None:
    fresh = cast(RolloutClient, object())
    tries: list[int] = []

    async def second_try_starts(rank: int, model_dir: str, version: int) -> RolloutClient:
        tries.append(rank)
        if len(tries) == 1:
            raise RolloutFailed("no answer to start after 300 s (run.call_timeout_s)",
                                worker_gone=True, timed_out=True)
        return fresh

    async def main() -> None:
        lost = cast(RolloutClient, object())
        totals = StepTotals()
        pool = RolloutPool({0: lost}, limit=1, max_restarts=3, totals=totals,
                           restart=second_try_starts, current_policy=_current_policy,
                           exit_wait_s=1.0)
        async with pool.replacing():
            pool.retire(0, lost, "dead")
            assert await pool.any_live() == (0, fresh)  # waits through both tries
        assert tries == [0, 0]
        assert (totals.restarts, totals.failed_restarts) == (2, 1)

    anyio.run(main)


def test_a_new_limit_applies_live_a_raised_one_wakes_a_wait_for_a_slot() -> None:
    async def current_policy(rank: int) -> tuple[str, int]:
        return "", 0

    async def main() -> None:
        workers = {0: cast(RolloutClient, object())}
        pool = RolloutPool(workers, limit=1, max_restarts=0, totals=StepTotals(),
                           restart=None, current_policy=current_policy, exit_wait_s=1.0)
        assert (await pool.acquire(lambda: None))[0] == 0 and pool.full()
        got: list[int] = []

        async def second() -> None:
            got.append((await pool.acquire(lambda: None))[0])

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(second)
            await anyio.wait_all_tasks_blocked()
            assert got == []  # waits for a slot
            await pool.set_limit(4)
        assert got == [0] and pool.busy[0] == 2 and not pool.full()
        await pool.set_limit(2)  # lowered: what it holds stays, no more is given
        assert pool.full()
        await pool.release(0)
        assert not pool.full()

    anyio.run(main)
