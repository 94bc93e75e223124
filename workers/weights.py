"""Versioned weight broadcast: trainer shard 0 publishes, every rollout worker loads.

Owns: the order of a broadcast (serialise on the source shard, hand the bytes to Ray's
object store once, let every rollout worker pull them and load them into its engine) and
its timing, split into publish, transfer, pause and load. Knows nothing about when to
broadcast (the controller decides) or how an engine loads (the rollout worker does).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import ray

from async_rl.records import BroadcastTiming


class WeightBroadcast:
    """Publishes the source shard's weights to a set of rollout worker actors."""

    def __init__(self, source_shard: Any, rollout_workers: dict[int, Any]) -> None:
        self.source_shard = source_shard
        self.rollout_workers = rollout_workers
        """rank -> actor handle; the controller removes dead workers from it."""

    async def publish(self, version: int) -> list[BroadcastTiming]:
        """Makes ``version`` the policy of every live rollout worker; returns their timings."""
        started = time.perf_counter()
        # Stays in the object store: each worker's node pulls it once, passed as a ref.
        state_ref = self.source_shard.state_bytes.remote()
        await asyncio.to_thread(ray.wait, [state_ref], fetch_local=False)
        publish_s = time.perf_counter() - started
        published_at = time.time()
        timings: list[BroadcastTiming] = await asyncio.gather(
            *(
                worker.update_weights.remote(version, state_ref, published_at)
                for worker in self.rollout_workers.values()
            )
        )
        return [msgspec.structs.replace(t, publish_s=publish_s) for t in timings]
