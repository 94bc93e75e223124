"""The staleness of the groups a replay queue hands out, split at their entering it.

Owns: the policy version a group entered the queue at (read from the run's version
source as it enters, or without one the last take's version; never below the group's own
``min_version``, whose tokens' versions were published before it entered), the histogram
of the staleness groups were taken at, and the ``TakenGroups`` record a take hands out.
Knows nothing about order, bounds, drops or waiting: ``ReplayQueue`` asks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic

from buffers.queue.queue_records import Queued, T, TakenGroups

__all__ = ["TakenStaleness"]


class TakenStaleness(Generic[T]):
    """One queue's entering versions and taken-staleness histogram."""

    def __init__(self, max_staleness: int, policy_version: Callable[[], int] | None) -> None:
        self.max_staleness = max_staleness
        self._policy_version = policy_version
        self.histogram = [0] * (max_staleness + 1)
        """Entry s counts the groups taken at staleness s."""

    def queued(self, item: T, sink_version: int | None,
               entered_version: int | None = None) -> Queued[T]:
        """The group as the store keeps it, entered at ``entered_version`` (None: now)."""
        if entered_version is None:
            now = (self._policy_version() if self._policy_version else sink_version or 0)
            # A version source that lags (the last take's) must not put the entry
            # before the group's own tokens.
            entered_version = max(now, item.min_version)
        return Queued(item, entered_version, item.min_version, item.num_tokens)

    def taken(self, entries: Sequence[Queued[T]], at_version: int) -> TakenGroups[T]:
        """Counts the taken groups' staleness; the record of the take."""
        hist = self.histogram
        for queued in entries:
            # A group newer than the taker (only a caller's bug can make one) counts as 0.
            hist[max(0, at_version - queued.min_version)] += 1
        return TakenGroups(groups=tuple([queued.item for queued in entries]),
                           at_version=at_version,
                           entered_versions=tuple([queued.entered_version for queued in entries]))

    def set_bound(self, max_staleness: int) -> None:
        """A live bound: the histogram grows to hold it (a lowered one keeps its entries
        of groups taken under the higher bound)."""
        self.max_staleness = max_staleness
        self.histogram += [0] * (max_staleness + 1 - len(self.histogram))

    def restore(self, histogram: Sequence[int]) -> None:
        """Loads a saved histogram (cut or padded to this queue's max_staleness)."""
        hist = list(histogram[: self.max_staleness + 1])
        self.histogram = hist + [0] * (self.max_staleness + 1 - len(hist))
