"""A bounded, token-length-bucketed replay queue with a sink-side staleness check.

Owns: where groups wait between rollout and training, in which order they leave
(oldest ``min_version`` first, then arrival), the bounds (groups and tokens) that push
back on producers (groups and staleness may change while a run trains: ``resize``,
``set_max_staleness``), the rule that no group older than ``max_staleness`` versions is ever
handed to a taker, and a take's wait for groups still being generated that it must
hold (``expecting``; the rule is ``buffers.queue.in_flight``'s). Knows nothing about
prompts, rewards, trainers or Ray: a group is anything with ``prompt_id``,
``min_version`` and ``num_tokens`` (``QueueItem``), and a dropped group is handed to the
``on_drop`` callback so its prompt can be re-run (``buffers.queue.drop_accounting``).
Each group's policy version when it entered is kept beside it and handed out with the
take (``TakenGroups``), so its staleness splits in two (``buffers.queue.taken_staleness``).
This module is the calls (put, take, ``expecting``, the live bounds, close and drain,
statistics, snapshot, restore and readmit); the queue's state and the steps they share
(fit, room, stale on arrival, a take's readiness, popping, whom to wake) are
``buffers.queue.queue_core``'s.

Speed: ``put`` and ``take`` do not yield to the event loop when they need not wait (like
``asyncio.Queue``), because a checkpoint per call would cost more than the queue itself.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import anyio

from buffers.common.config import QueueConfig, StalenessConfig
from buffers.queue.drop_accounting import DropHandler
from buffers.queue.errors import NotEnoughGroups, QueueClosed, QueueFull
from buffers.queue.queue_core import QueueCore
from buffers.queue.queue_records import (
    DROP_STALE,
    Dropped,
    QueueItem,
    ReplayQueueSnapshot,
    ReplayQueueStatistics,
    T,
    TakenGroups,
)
from buffers.queue.waiters import Waiter

__all__ = ["QueueItem", "ReplayQueue"]


class ReplayQueue(QueueCore[T]):
    """Groups wait here, bucketed by token count, until a trainer takes them.

    ``bucket_edges`` are increasing token counts: edges ``(1024, 4096)`` make buckets
    ``[0, 1024)``, ``[1024, 4096)`` and ``[4096, inf)``. A group that could never fit
    (more than ``max_tokens``) is refused with ``ValueError`` rather than waiting forever.
    ``wait_for_expiring``: see ``take``. ``clock``: what waits are timed with (a
    simulation passes its virtual clock). ``policy_version``: the policy's version now,
    read as a group enters (None: the last take's ``at_version``, 0 before the first).
    """

    @classmethod
    def from_config(cls, queue: QueueConfig, staleness: StalenessConfig, *,
                    on_drop: DropHandler[T] | None = None,
                    clock: Callable[[], float] = time.perf_counter,
                    policy_version: Callable[[], int] | None = None) -> ReplayQueue[T]:
        """The queue its section describes (bounds, buckets, wait_for_expiring), keeping
        staleness.max_staleness."""
        return cls(max_groups=queue.max_groups, max_tokens=queue.max_tokens,
                   bucket_edges=queue.bucket_edges, max_staleness=staleness.max_staleness,
                   on_drop=on_drop, wait_for_expiring=queue.wait_for_expiring, clock=clock,
                   policy_version=policy_version)

    def __len__(self) -> int:
        return self._store.groups

    # -- put -------------------------------------------------------------------------

    def put_nowait(self, item: T) -> bool:
        """Adds a group now (True), drops it as stale (False, see ``on_drop``), or raises
        ``QueueFull`` (no room, or earlier puts waiting)."""
        if self._closed:
            raise QueueClosed
        self._check_fits(item)
        if self._drop_if_stale(item):
            return False
        if self._putters or not self._has_room(item.num_tokens):
            raise QueueFull
        self._insert(item)
        return True

    async def put(self, item: T) -> bool:
        """Adds a group, waiting while the queue is full (backpressure; FIFO among
        putters): True once it is in, False when it was dropped as stale instead."""
        if self._closed:
            raise QueueClosed
        self._check_fits(item)
        if self._drop_if_stale(item):
            return False
        if not self._putters and self._has_room(item.num_tokens):
            self._insert(item)
            return True
        waiter = Waiter(item.num_tokens)
        self._putters.append(waiter)
        self._putters.waits += 1
        started = self._clock()
        try:
            while True:
                self._wake_starved_taker()
                await waiter.event.wait()
                if self._closed:
                    raise QueueClosed
                if self._drop_if_stale(item):
                    return False
                if self._putters[0] is waiter and self._has_room(item.num_tokens):
                    self._insert(item)
                    return True
                waiter.event = anyio.Event()
        finally:
            self._putters.remove(waiter)
            self._putters.wait_s += self._clock() - started
            self._wake_putter()

    # -- take ------------------------------------------------------------------------

    def take_nowait(self, n_groups: int, at_version: int, *, homogeneous: bool = False) -> list[T]:
        """Takes ``n_groups`` now (oldest first), or raises ``NotEnoughGroups`` (also
        while ``take`` would wait for an expiring group).

        Stale groups are dropped first either way. See ``take`` for ``homogeneous``.
        """
        self._advance_sink(n_groups, at_version)
        if self._takers or not self._ready(n_groups, at_version):
            raise QueueClosed if self._closed else NotEnoughGroups
        return list(self._pop(n_groups, at_version, homogeneous).groups)

    async def take(self, n_groups: int, at_version: int, *, homogeneous: bool = False) -> list[T]:
        """``take_groups``' groups, oldest first."""
        return list((await self.take_groups(n_groups, at_version,
                                            homogeneous=homogeneous)).groups)

    async def take_groups(self, n_groups: int, at_version: int, *,
                          homogeneous: bool = False) -> TakenGroups[T]:
        """Takes ``n_groups`` groups for training at policy version ``at_version``, with
        the version each entered the queue at.

        Waits until that many are queued, and with ``wait_for_expiring`` for every group
        announced by ``expecting`` that this take must hold: those whose last chance it
        is, and any the takes after it could not all fit (``buffers.queue.in_flight``). Without
        the wait newer groups are trained and the late one, the slowest to generate and
        so the longest, is dropped on arrival. Groups with ``at_version - min_version >
        max_staleness`` are dropped (see ``on_drop``), never returned. Without
        ``homogeneous`` the result is the oldest groups (by min_version, then arrival).
        With it, groups are drawn from one token bucket (then its nearest neighbours) so
        micro-batches pad little; the bound it keeps: the oldest group is always taken,
        and so is every group that would be too stale at ``at_version + 1``, so a group
        is only passed over while it can still be trained. With ``max_staleness == 0``
        it is exactly oldest-first.
        Raises ``QueueClosed`` when closed while waiting, ``QueueTooSmall`` when the
        token bound makes the take impossible.
        """
        self._advance_sink(n_groups, at_version)
        if not self._takers and self._ready(n_groups, at_version):
            return self._pop(n_groups, at_version, homogeneous)
        if self._closed:
            raise QueueClosed
        waiter = Waiter(n_groups, at_version)
        self._takers.append(waiter)
        self._takers.waits += 1
        started = self._clock()
        try:
            while True:
                self._check_starved(waiter)
                await waiter.event.wait()
                if self._closed:
                    raise QueueClosed
                if self._takers[0] is waiter and self._ready(n_groups, at_version):
                    return self._pop(n_groups, at_version, homogeneous)
                waiter.event = anyio.Event()
        finally:
            self._takers.remove(waiter)
            self._takers.wait_s += self._clock() - started
            self._wake_taker()

    @contextlib.contextmanager
    def expecting(self, version: int) -> Iterator[None]:
        """Announces a group being generated whose tokens are no older than ``version``.

        Wrap the generation, not the put: on leaving (with the group or an error) the
        announcement ends, and a take that waited for it goes on. A group that then
        waits for room is not waited for: the take is what makes the room.
        """
        self._in_flight.add(version)
        try:
            yield
        finally:
            self._in_flight.remove(version)
            self._wake_taker()

    # -- live bounds (a run retuned while it trains) -----------------------------------

    def resize(self, max_groups: int) -> None:
        """A new capacity in groups. Below what is queued, puts wait until takes make
        room; a take may not want more than it."""
        if max_groups < 1:
            raise ValueError(f"max_groups={max_groups}: must be >= 1")
        self.max_groups = max_groups
        self._wake_putter()

    def set_max_staleness(self, max_staleness: int) -> None:
        """A new staleness bound. Lowered, the queued groups now too stale for the last
        take's version are dropped (``on_drop``), as are later puts and takes' stale
        groups: no group older than the bound in force is ever handed to a taker."""
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = self._in_flight.max_staleness = max_staleness
        self._staleness.set_bound(max_staleness)
        sink = self._sink_version
        if sink is not None and (stale := self._store.pop_older_than(sink - max_staleness)):
            self._drops.drop([queued.item for queued in stale], DROP_STALE, sink)
        for waiter in self._putters:  # their groups may be stale now
            waiter.event.set()
        self._wake_taker()

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Refuses further puts and releases every waiter with ``QueueClosed``.

        Queued groups stay (for ``drain`` or ``snapshot``); a take that can be served at
        once still is.
        """
        self._closed = True
        for waiter in (*self._putters, *self._takers):
            waiter.event.set()

    def drain(self) -> list[T]:
        """Removes and returns every queued group, oldest first (shutdown, tests)."""
        items = [queued.item for queued in self._store.pop_oldest(self._store.groups)]
        self._drained_total += len(items)
        self._wake_putter()
        return items

    def drain_dropped(self) -> list[Dropped[T]]:
        """Returns and forgets the drops kept because no ``on_drop`` handler was given."""
        return self._drops.drain()

    def statistics(self) -> ReplayQueueStatistics:
        return ReplayQueueStatistics(
            groups=self._store.groups,
            tokens=self._store.tokens,
            max_groups=self.max_groups,
            max_tokens=self.max_tokens,
            max_staleness=self.max_staleness,
            buckets=self._drops.buckets(self._store.bucket_groups, self._store.bucket_tokens),
            put_waits=self._putters.statistics(),
            take_waits=self._takers.statistics(),
            put_total=self._put_total,
            taken_total=self._taken_total,
            drained_total=self._drained_total,
            drops=dict(self._drops.by_reason),
            staleness_taken=tuple(self._staleness.histogram),
            sink_version=self._sink_version,
            closed=self._closed,
        )

    def snapshot(self) -> ReplayQueueSnapshot[T]:
        """The contents (oldest first) and counters, without changing the queue."""
        return ReplayQueueSnapshot(
            items=tuple(queued.item for queued in self._store),
            entered_versions=tuple(queued.entered_version for queued in self._store),
            sink_version=self._sink_version,
            put_total=self._put_total,
            taken_total=self._taken_total,
            drained_total=self._drained_total,
            drops=self._drops.counts(),
            staleness_taken=tuple(self._staleness.histogram),
        )

    def restore(self, snapshot: ReplayQueueSnapshot[T]) -> None:
        """Loads a snapshot into this new, empty queue.

        The bounds are this queue's (the run may have changed them); restored groups are
        admitted even beyond them, and later puts wait until takes make room. Per-bucket
        counts survive only if the bucket edges are the same. Groups of a snapshot that
        kept no entry versions enter now.
        """
        if self._store.groups or self._put_total or self._putters or self._takers:
            raise RuntimeError("restore() needs a new, empty queue")
        self._sink_version = snapshot.sink_version
        entered = snapshot.entered_versions or (None,) * len(snapshot.items)
        for item, version in zip(snapshot.items, entered, strict=True):
            self._check_fits(item)
            self._insert(item, version)
        self._put_total = snapshot.put_total
        self._taken_total = snapshot.taken_total
        self._drained_total = snapshot.drained_total
        self._drops.restore(snapshot.drops)
        self._staleness.restore(snapshot.staleness_taken)

    def readmit(self, items: Sequence[T], entered_versions: Sequence[int | None],
                at_version: int) -> None:
        """Groups a checkpoint kept, back in this new queue for takes from ``at_version``
        on (a resumed run's policy version), each with the version it first entered at
        (None: now): those within ``max_staleness`` are queued, even beyond the bounds
        (as ``restore``), the others dropped as stale (``on_drop``), as the first take at
        that version would drop them. All count as this queue's puts."""
        if self._store.groups or self._putters or self._takers:
            raise RuntimeError("readmit() needs a new, empty queue")
        self._sink_version = at_version
        for item, version in zip(items, entered_versions, strict=True):
            self._check_fits(item)
            if not self._drop_if_stale(item):
                self._insert(item, version)
