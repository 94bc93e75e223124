"""The shapes the replay queue takes in and hands out: its item protocol and its records.

Owns: ``QueueItem`` (what the queue needs to know about a group), ``Queued`` (a group as
the queue stores it: with the policy version it entered at) and the frozen records the
queue returns (``TakenGroups``, ``Dropped``, ``ReplayQueueStatistics``,
``ReplayQueueSnapshot``, ``DropCounts``).
Knows nothing about how a group is generated, scored or trained; the project's real
item, ``buffers.common.records.Group``, satisfies ``QueueItem`` structurally, without an import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import msgspec

__all__ = [
    "DROP_STALE",
    "BucketStatistics",
    "DropCounts",
    "Dropped",
    "QueueItem",
    "Queued",
    "ReplayQueueSnapshot",
    "ReplayQueueStatistics",
    "TakenGroups",
    "WaitStatistics",
]

DROP_STALE = "stale"
"""Drop reason: at take time the group's staleness exceeded ``max_staleness``."""


class QueueItem(Protocol):
    """What the replay queue reads from a group; read-only, so frozen Structs satisfy it."""

    @property
    def prompt_id(self) -> str:
        """Handed back on a drop, so the controller can re-queue the prompt."""
        ...

    @property
    def min_version(self) -> int:
        """Oldest policy version of any token: the age order and the staleness base."""
        ...

    @property
    def num_tokens(self) -> int:
        """Tokens over all samples: the bucket key and the unit of the token bound."""
        ...


T = TypeVar("T", bound=QueueItem)


class Queued(msgspec.Struct, Generic[T], frozen=True, gc=False):
    """A group in the queue's store, with the policy version when it entered.

    Its ``min_version`` and ``num_tokens`` are copied: the store reads them on every walk,
    and a field is quicker than the group's own property. Not tracked by the garbage
    collector (``gc=False``: a full queue is many objects, and the group it holds never
    refers back to it, so it can be in no cycle)."""

    item: T
    entered_version: int
    min_version: int
    num_tokens: int

    @property
    def prompt_id(self) -> str:
        return self.item.prompt_id


class TakenGroups(msgspec.Struct, Generic[T], frozen=True, kw_only=True):
    """One take's groups, and when each entered the queue: its staleness split in two.

    A group's staleness, ``at_version - min_version`` (what ``max_staleness`` bounds), is
    exactly ``in_flight() + in_queue()``: the versions published while it was generated
    and those published while it waited to be taken."""

    groups: tuple[T, ...]
    """Oldest first (by min_version, then arrival), or as ``sorted_by`` put them."""
    at_version: int
    """The taker's policy version: the one the groups are trained under."""
    entered_versions: tuple[int, ...]
    """Per group: the policy version when it entered the queue (never below its own
    ``min_version``)."""

    def in_flight(self) -> tuple[int, ...]:
        """Per group: versions published while it was generated (from its oldest token
        to its entering the queue)."""
        return tuple(entered - g.min_version
                     for g, entered in zip(self.groups, self.entered_versions, strict=True))

    def in_queue(self) -> tuple[int, ...]:
        """Per group: versions published while it waited in the queue."""
        return tuple(self.at_version - entered for entered in self.entered_versions)

    def sorted_by(self, key: Callable[[T], Any]) -> TakenGroups[T]:
        """The same take with its groups (and their versions) in ``key`` order."""
        pairs = sorted(zip(self.groups, self.entered_versions, strict=True),
                       key=lambda pair: key(pair[0]))
        return TakenGroups(groups=tuple(g for g, _ in pairs), at_version=self.at_version,
                           entered_versions=tuple(v for _, v in pairs))


class Dropped(msgspec.Struct, Generic[T], frozen=True, kw_only=True):
    """A group the queue removed without handing it to a taker; its prompt must be re-run."""

    prompt_id: str
    """The prompt to re-queue (and whose admission slot to give back)."""
    reason: str
    """Why: ``DROP_STALE``."""
    min_version: int
    at_version: int
    """The taker's policy version that made the group too stale."""
    item: T
    """The dropped group itself, for the ledger."""


class BucketStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """One token-count bucket (groups with ``low <= num_tokens < high``): what it holds
    now, and how many of its groups were put and dropped since the queue was made."""

    low: int
    high: int | None
    """Exclusive upper edge; None for the last, open-ended bucket."""
    groups: int
    tokens: int
    put_total: int
    """Groups of this bucket put, those dropped on arrival included."""
    dropped: int
    """Of those, dropped as stale: ``dropped / put_total`` is the bucket's drop rate."""


class WaitStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """How often and how long one side of the queue had to wait."""

    count: int
    """Calls that had to wait at least once (fast-path calls are not counted)."""
    seconds: float
    """Total seconds of finished waits (a wait still in progress is not included)."""
    waiting_now: int
    """Tasks waiting at the moment the statistics were taken."""


class ReplayQueueStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A point-in-time view of the replay queue, cheap enough to log every step."""

    groups: int
    tokens: int
    max_groups: int
    max_tokens: int
    max_staleness: int
    buckets: tuple[BucketStatistics, ...]
    put_waits: WaitStatistics
    take_waits: WaitStatistics
    put_total: int
    """Groups accepted by put (including those dropped on arrival as already stale)."""
    taken_total: int
    drained_total: int
    drops: dict[str, int]
    """Dropped groups by reason; ``put_total == taken + dropped + drained + groups``."""
    staleness_taken: tuple[int, ...]
    """Histogram of the groups taken: entry s counts groups trained at staleness s."""
    sink_version: int | None
    """The highest ``at_version`` a taker has presented (None before the first take)."""
    closed: bool


class DropCounts(msgspec.Struct, frozen=True, kw_only=True):
    """A queue's drop counters, as its snapshot keeps them."""

    by_reason: dict[str, int]
    bucket_edges: tuple[int, ...]
    """The edges the per-bucket counts were taken with."""
    put_by_bucket: tuple[int, ...]
    """Groups put per bucket, those dropped on arrival included."""
    dropped_by_bucket: tuple[int, ...]


class ReplayQueueSnapshot(msgspec.Struct, Generic[T], frozen=True, kw_only=True):
    """The queue's contents and counters, for a checkpoint (decode as ``Snapshot[Group]``)."""

    items: tuple[T, ...]
    """Queued groups, oldest first (by min_version, then arrival)."""
    sink_version: int | None
    put_total: int
    taken_total: int
    drained_total: int
    drops: DropCounts
    staleness_taken: tuple[int, ...]
    entered_versions: tuple[int, ...] = ()
    """Per item: the policy version when it entered the queue. Empty in snapshots made
    before it was kept: their groups count as entered at the restore."""
