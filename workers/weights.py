"""Versioned weight broadcast: trainer shard 0 publishes, every rollout worker loads.

Owns: the two halves of a broadcast and their timing — ``publish`` (serialise on the
source shard into Ray's object store, once) and ``deliver`` (every rollout worker pulls
the bytes and loads them into its engine), split into publish, transfer, pause and load.
The halves are separate so the trainer can go on with the next step while rollout
workers load. Knows nothing about when to broadcast (the controller decides) or how an
engine loads (the rollout worker does).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import ray

from async_rl.records import BroadcastTiming


class Published(msgspec.Struct, frozen=True, kw_only=True):
    """A version's weights sitting in the object store, ready to deliver."""

    version: int
    state: Any
    """ObjectRef of the safetensors bytes (kept in the store; never fetched here)."""
    publish_s: float
    published_at: float


class WeightBroadcast:
    """Publishes the source shard's weights to a set of rollout worker actors."""

    def __init__(self, source_shard: Any, rollout_workers: dict[int, Any]) -> None:
        self.source_shard = source_shard
        self.rollout_workers = rollout_workers
        """rank -> actor handle; the controller removes dead workers from it."""

    async def publish(self, version: int) -> Published:
        """Snapshots the source shard's weights as ``version``.

        The snapshot call is queued on the shard before any later training call, so it
        captures exactly the weights of ``version`` even if training goes on meanwhile.
        """
        started = time.perf_counter()
        state_ref = self.source_shard.state_bytes.remote()
        await asyncio.to_thread(ray.wait, [state_ref], fetch_local=False)
        return Published(version=version, state=state_ref,
                         publish_s=time.perf_counter() - started, published_at=time.time())

    async def deliver(self, published: Published) -> tuple[list[BroadcastTiming], list[int]]:
        """Makes the published version the policy of every live rollout worker.

        Returns the timings of the workers that loaded it and the ranks of those that
        failed (a failed load leaves a worker unusable; the caller retires it).
        """
        ranks = list(self.rollout_workers)
        # Passed as a top-level argument, the ref is resolved by Ray on each worker's node.
        outcomes = await asyncio.gather(
            *(
                self.rollout_workers[rank].update_weights.remote(
                    published.version, published.state, published.published_at
                )
                for rank in ranks
            ),
            return_exceptions=True,
        )
        timings = [msgspec.structs.replace(t, publish_s=published.publish_s)
                   for t in outcomes if isinstance(t, BroadcastTiming)]
        failed = [rank for rank, t in zip(ranks, outcomes, strict=True)
                  if isinstance(t, BaseException)]
        return timings, failed
