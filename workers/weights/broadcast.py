"""Versioned weight broadcast: trainer shard 0 publishes, every rollout worker loads.

Owns: the two halves of a broadcast as the controller drives them — ``publish`` (the
source shard snapshots the weights of a version, once) and ``deliver`` (the source shard
broadcasts that snapshot to every live rollout worker at once through vLLM's
weight-transfer API, ``workers.weights.sender``, then frees it) — the ``Delivery``
record of one broadcast, and its timing, split into publish, transfer, pause and load.
The halves are separate so the trainer can go on with the next step while rollout
workers load: sends run in the source shard's ``SEND_GROUP`` concurrency group, beside
its training calls. Knows nothing about when to broadcast (the controller decides) or
how an engine loads (the rollout worker does).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from buffers.common.concurrent_calls import each
from buffers.common.reports import BroadcastTiming

SEND_GROUP = "weights"
"""Ray concurrency group of the source shard's sends: a send is not queued behind a
training step, as calls in the default group are."""

log = logging.getLogger(__name__)


class Delivery(msgspec.Struct, frozen=True, kw_only=True):
    """One version's broadcast, as the source shard reports it."""

    timings: list[BroadcastTiming]
    """The rollout workers that loaded the version (publish_s 0: the shard's send does
    not know it)."""
    failed: list[int]
    """Rollout workers lost (dead, stuck, or no longer trusted): the controller retires
    them. A member in neither list kept its old weights, whole, and takes the next
    version."""
    wire_start: float
    wire_end: float
    """From the first byte sent until the last worker held every byte, on the shard's
    ``time.time()`` (the last attempt that moved bytes; 0 when none did)."""
    attempts: int
    """Broadcasts it took: 1, or more when a lost member interrupted the others."""

    @property
    def wire_s(self) -> float:
        return self.wire_end - self.wire_start


class Published(msgspec.Struct, frozen=True, kw_only=True):
    """A version's weights snapshotted on the source shard, ready to deliver."""

    version: int
    publish_s: float
    bytes: int = 0
    """The snapshot's size (the source shard's answer)."""


class WeightBroadcast:
    """Publishes the source shard's weights to the rollout workers it is connected to
    (``connect_rollout``, at start-up and when a worker is replaced), by rank."""

    def __init__(self, source_shard: Any, gather_from: Sequence[Any] = ()) -> None:
        self.source_shard = source_shard
        self.gather_from = list(gather_from)
        """The other shards, which take part in each snapshot (FSDP2: the source shard
        gathers the whole weights from all of them); empty when shards are replicas."""

    async def publish(self, version: int) -> Published:
        """Snapshots the source shard's weights as ``version``.

        The snapshot call is queued on the shard before any later training call, so it
        captures exactly the weights of ``version`` even if training goes on meanwhile.
        """
        started = time.perf_counter()
        sizes = await each([functools.partial(shard.snapshot_weights.remote, version)
                            for shard in [self.source_shard, *self.gather_from]])
        return Published(version=version, publish_s=time.perf_counter() - started,
                         bytes=sizes[0])

    async def deliver(self, published: Published, ranks: Sequence[int]
                      ) -> tuple[list[BroadcastTiming], list[int]]:
        """Makes the published version the policy of the rollout workers ``ranks`` (the
        live ones: the controller knows which), in one broadcast.

        Returns the timings of the workers that loaded it and the ranks of those that
        were lost (the caller retires them). A lost worker fails the broadcast for the
        others, which take it again over a group without it.
        """
        send = self.source_shard.send_weights.options(concurrency_group=SEND_GROUP)
        try:
            delivery: Delivery = await send.remote(published.version, list(ranks))
        except Exception as err:  # the shard's own failure: nothing can be trusted
            log.warning("weights v%d: the send failed: %r", published.version, err)
            delivery = Delivery(timings=[], failed=list(ranks), wire_start=0.0,
                                wire_end=0.0, attempts=0)
        release = self.source_shard.release_weights.options(concurrency_group=SEND_GROUP)
        await release.remote(published.version)
        timings = [msgspec.structs.replace(t, publish_s=published.publish_s,
                                           bytes=published.bytes)
                   for t in delivery.timings]
        return timings, list(delivery.failed)
