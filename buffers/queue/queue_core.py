"""The replay queue's state, and the steps its calls are made of.

Owns: checking a queue's bounds and building its parts (the store, drop accounting,
in-flight count, taken staleness and the two wait lines), and the steps ``ReplayQueue``'s
calls share: whether a group could ever fit and whether it has room now, dropping a group
that arrives stale, whether a take is ready (enough groups queued, none it must hold
still generating), moving the sink version on (dropping the groups gone stale), popping a
take's groups, waking the head putter or taker once it may go on, and failing a take
that the token bound starves (``QueueTooSmall``). Knows nothing about the calls
themselves (how a put or take parks and retries), the live bounds or checkpoints:
``buffers.queue.replay_queue``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Generic

from buffers.common.config import bucket_index
from buffers.queue.drop_accounting import DropAccounting, DropHandler
from buffers.queue.errors import QueueTooSmall
from buffers.queue.in_flight import InFlight
from buffers.queue.queue_records import DROP_STALE, Queued, T, TakenGroups
from buffers.queue.replay_store import BucketedStore
from buffers.queue.taken_staleness import TakenStaleness
from buffers.queue.waiters import Waiter, WaitLine

__all__ = ["QueueCore"]


class QueueCore(Generic[T]):
    """A replay queue's state and shared steps; ``ReplayQueue`` adds the calls (and
    documents the arguments)."""

    def __init__(
        self,
        *,
        max_groups: int,
        max_tokens: int,
        max_staleness: int,
        bucket_edges: Sequence[int] = (),
        on_drop: DropHandler[T] | None = None,
        wait_for_expiring: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        policy_version: Callable[[], int] | None = None,
    ) -> None:
        if max_groups < 1 or max_tokens < 1:
            raise ValueError(f"max_groups={max_groups}, max_tokens={max_tokens}: both must be >= 1")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        edges = tuple(int(e) for e in bucket_edges)
        if any(e <= 0 for e in edges) or any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(f"bucket_edges must be positive and strictly increasing, got {edges}")
        self.max_groups = max_groups
        self.max_tokens = max_tokens
        self.max_staleness = max_staleness
        self.bucket_edges = edges
        self.wait_for_expiring = wait_for_expiring
        self._clock = clock
        self._drops: DropAccounting[T] = DropAccounting(edges, on_drop)
        self._store: BucketedStore[Queued[T]] = BucketedStore(edges)
        self._in_flight = InFlight(max_staleness)
        self._sink_version: int | None = None
        self._closed = False
        self._putters = WaitLine()
        self._takers = WaitLine()
        self._put_total = 0
        self._taken_total = 0
        self._drained_total = 0
        self._staleness: TakenStaleness[T] = TakenStaleness(max_staleness, policy_version)

    # -- the steps the calls share ---------------------------------------------------

    def _check_fits(self, item: T) -> None:
        if item.num_tokens > self.max_tokens:
            raise ValueError(
                f"group {item.prompt_id!r} has {item.num_tokens} tokens, more than "
                f"max_tokens={self.max_tokens}: it could never be queued; raise max_tokens"
            )

    def _has_room(self, tokens: int) -> bool:
        store = self._store
        return store.groups < self.max_groups and store.tokens + tokens <= self.max_tokens

    def _insert(self, item: T, entered_version: int | None = None) -> None:
        """Stores the group, entered at ``entered_version`` (None: now)."""
        queued = self._staleness.queued(item, self._sink_version, entered_version)
        self._drops.put_by_bucket[self._store.insert(queued)] += 1
        self._put_total += 1
        if self._takers:
            self._wake_taker()

    def _drop_if_stale(self, item: T) -> bool:
        sink = self._sink_version
        if sink is None or sink - item.min_version <= self.max_staleness:
            return False
        # Dropped on arrival: a taker already works at a version this group is too old
        # for, so keeping it would only hold room (and an admission slot) hostage.
        self._put_total += 1
        self._drops.put_by_bucket[bucket_index(self.bucket_edges, item.num_tokens)] += 1
        self._drops.drop([item], DROP_STALE, sink)
        return True

    def _ready(self, n_groups: int, at_version: int) -> bool:
        """Enough groups are queued, and none the take must hold is still generating."""
        if self._store.groups < n_groups:
            return False
        if not (self.wait_for_expiring and self._in_flight.by_version):
            return True
        return not self._in_flight.must_wait(n_groups, at_version, self._store.groups_up_to)

    def _advance_sink(self, n_groups: int, at_version: int) -> None:
        if n_groups < 1 or n_groups > self.max_groups:
            raise ValueError(f"n_groups={n_groups}: must be in [1, max_groups={self.max_groups}]")
        sink = self._sink_version
        if sink is not None and at_version < sink:
            raise ValueError(f"at_version went back from {sink} to {at_version}")
        if sink == at_version:
            return
        self._sink_version = at_version
        stale = self._store.pop_older_than(at_version - self.max_staleness)
        if stale:
            self._drops.drop([queued.item for queued in stale], DROP_STALE, at_version)
        # Parked putters re-check: their groups may now be stale, and room may have opened.
        for waiter in self._putters:
            waiter.event.set()

    def _pop(self, n: int, at_version: int, homogeneous: bool) -> TakenGroups[T]:
        if homogeneous and self.bucket_edges and self.max_staleness > 0:
            # Urgent: groups that would be too stale at the next version must go now.
            items = self._store.pop_homogeneous(n, at_version + 1 - self.max_staleness)
        else:
            items = self._store.pop_oldest(n)
        self._taken_total += len(items)
        self._wake_putter()
        return self._staleness.taken(items, at_version)

    def _wake_putter(self) -> None:
        if self._putters:
            head = self._putters[0]
            if self._closed or self._has_room(head.need):
                head.event.set()

    def _wake_taker(self) -> None:
        if self._takers:
            head = self._takers[0]
            if self._closed or self._ready(head.need, head.at_version):
                head.event.set()

    def _wake_starved_taker(self) -> None:
        # A putter just parked: if the head taker wants more groups than are queued, only
        # that taker could free room, so it must wake and find out it never will.
        if self._takers and self._takers[0].need > self._store.groups:
            self._takers[0].event.set()

    def _check_starved(self, waiter: Waiter) -> None:
        if self._takers[0] is not waiter or self._store.groups >= waiter.need or not self._putters:
            return
        head = self._putters[0]
        if head.event.is_set() or self._has_room(head.need):
            return  # that putter is about to run and may still fit or be dropped
        raise QueueTooSmall(
            f"take of {waiter.need} groups can never be served: the queue holds "
            f"{self._store.groups} groups ({self._store.tokens} tokens) and the next group "
            f"({head.need} tokens) does not fit in max_tokens={self.max_tokens}"
        )
