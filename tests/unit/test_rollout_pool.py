"""RolloutPool picks the least-busy live worker, ties to the earliest in its map's order
(a restarted worker last), as a scan with min() over the map does."""

from __future__ import annotations

import random
from typing import cast

import anyio

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
                           restart=restart, current_policy=current_policy)
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
