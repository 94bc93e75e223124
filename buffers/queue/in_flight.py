"""Groups still being generated, and when a take must wait for them.

Owns: the count of groups announced as in flight, per version (``ReplayQueue.expecting``),
and the rule that says whether a take at version ``v`` of ``n`` groups has to wait for
one of them so that no group goes stale that could have been trained. A group whose
tokens are no older than version ``u`` can be trained up to take ``u + max_staleness``
(its deadline). Each take trains ``n`` groups, so of the groups whose deadline is at
most ``v + j``, all but ``j * n`` must be in take ``v``; oldest-first takes them when they
are queued, so a take waits while a group it must hold is still being generated
(earliest deadline first, with the wait). Knows nothing about waiting itself, bounds or
drops: ``ReplayQueue`` asks, with the count of queued groups by version.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["InFlight"]


class InFlight:
    """Announced groups by version; ``must_wait`` is the rule above."""

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.by_version: dict[int, int] = {}
        """Announced groups per version; empty when none is in flight."""

    def add(self, version: int) -> None:
        self.by_version[version] = self.by_version.get(version, 0) + 1

    def remove(self, version: int) -> None:
        left = self.by_version.pop(version) - 1
        if left:
            self.by_version[version] = left

    def must_wait(self, n_groups: int, at_version: int,
                  queued_up_to: Callable[[int], int]) -> bool:
        """True while a group the take must hold is in flight; ``queued_up_to(u)``:
        queued groups with ``min_version <= u``. An announced version is a lower bound,
        so a take may wait for a group a later take could still have trained, but never
        leaves out one it must hold."""
        for ahead in range(self.max_staleness + 1):
            # Groups whose deadline is at most take at_version + ahead.
            last = at_version + ahead - self.max_staleness
            flying = sum(count for version, count in self.by_version.items()
                         if version <= last)
            if not flying:
                continue
            queued = queued_up_to(last)
            if queued < min(n_groups, queued + flying - ahead * n_groups):
                return True
        return False
