"""The replay queue's drop accounting: what it dropped, why, and from which lengths.

Owns: the count of dropped groups by reason and by token-length bucket, the count of
groups put per bucket (the denominator of a bucket's drop rate), and handing each
dropped group to the ``on_drop`` callback, or keeping it for ``drain`` when there is none.
Per-bucket counts exist because drops are not length-neutral: the longest groups take
longest to generate, so they are the ones that arrive too stale. Knows nothing about
waiting, bounds or the order groups leave in: ``ReplayQueue`` says what it took in and
what it dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic

from buffers.common.config import bucket_index
from buffers.queue.queue_records import BucketStatistics, DropCounts, Dropped, T

__all__ = ["DropAccounting", "DropHandler"]

DropHandler = Callable[[Dropped[T]], None]
"""Called synchronously for every dropped group; typically re-queues the prompt and gives
its admission slot back. Without one, drops are kept for ``drain_dropped()``."""


class DropAccounting(Generic[T]):
    """Counters of one queue's drops; ``bucket_edges`` as in ``ReplayQueue``."""

    def __init__(self, bucket_edges: Sequence[int], on_drop: DropHandler[T] | None) -> None:
        self.edges = tuple(bucket_edges)
        self.by_reason: dict[str, int] = {}
        self.put_by_bucket = [0] * (len(self.edges) + 1)
        """Groups put per bucket, those dropped on arrival included; the queue counts
        them itself, on its hot path."""
        self.dropped_by_bucket = [0] * (len(self.edges) + 1)
        self._on_drop = on_drop
        self._kept: list[Dropped[T]] = []

    def drop(self, items: Sequence[T], reason: str, at_version: int) -> None:
        """Counts the dropped groups and hands each on (``on_drop``) or keeps it."""
        self.by_reason[reason] = self.by_reason.get(reason, 0) + len(items)
        for item in items:
            self.dropped_by_bucket[bucket_index(self.edges, item.num_tokens)] += 1
            dropped = Dropped(prompt_id=item.prompt_id, reason=reason,
                              min_version=item.min_version, at_version=at_version, item=item)
            if self._on_drop is None:
                self._kept.append(dropped)
            else:
                self._on_drop(dropped)

    def drain(self) -> list[Dropped[T]]:
        """Returns and forgets the drops kept because there is no ``on_drop``."""
        kept, self._kept = self._kept, []
        return kept

    def buckets(self, groups: Sequence[int], tokens: Sequence[int]
                ) -> tuple[BucketStatistics, ...]:
        """Per bucket: what it holds now (the store's ``groups`` and ``tokens`` by
        bucket), and its puts and drops so far."""
        lows = (0, *self.edges)
        highs: tuple[int | None, ...] = (*self.edges, None)
        counts = zip(lows, highs, groups, tokens, self.put_by_bucket, self.dropped_by_bucket,
                     strict=True)
        return tuple(BucketStatistics(low=lo, high=hi, groups=g, tokens=t, put_total=p,
                                      dropped=d) for lo, hi, g, t, p, d in counts)

    def counts(self) -> DropCounts:
        return DropCounts(by_reason=dict(self.by_reason), bucket_edges=self.edges,
                          put_by_bucket=tuple(self.put_by_bucket),
                          dropped_by_bucket=tuple(self.dropped_by_bucket))

    def restore(self, counts: DropCounts) -> None:
        """Loads saved counters. Per-bucket counts taken with other edges mean nothing
        here, so those start from zero (the counts by reason are kept either way)."""
        self.by_reason = dict(counts.by_reason)
        if counts.bucket_edges == self.edges:
            self.put_by_bucket = list(counts.put_by_bucket)
            self.dropped_by_bucket = list(counts.dropped_by_bucket)
