"""The replay queue's storage: groups ordered by age, counted per token bucket.

Owns: the order groups leave in (``min_version``, then arrival), the per-bucket group and
token counts, and the two selections a take can make (oldest-first, or one bucket and its
neighbours). Knows nothing about waiting, bounds, staleness policy or drops: those are
``ReplayQueue``'s; this is a plain synchronous container, so it is easy to reason about.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right, insort
from collections.abc import Iterator, Sequence
from typing import Generic

from buffers.queue.queue_records import T

__all__ = ["BucketedStore"]


class BucketedStore(Generic[T]):
    """Groups keyed by (min_version, arrival); ``bucket_edges`` as in ``ReplayQueue``."""

    def __init__(self, bucket_edges: Sequence[int]) -> None:
        self.edges = tuple(bucket_edges)
        # version -> {arrival seq: item}. Dicts keep insertion (= arrival) order, and a
        # sorted list of the few versions present gives the oldest-first walk without a
        # heap, so a put is two dict writes and a take pops whole versions at C speed.
        self._by_version: dict[int, dict[int, T]] = {}
        self._versions: list[int] = []
        self._seq = 0
        self.groups = 0
        self.tokens = 0
        self.bucket_groups = [0] * (len(self.edges) + 1)
        self.bucket_tokens = [0] * (len(self.edges) + 1)

    def __iter__(self) -> Iterator[T]:
        """Every stored group, oldest first, without removing any."""
        for version in self._versions:
            yield from self._by_version[version].values()

    def insert(self, item: T) -> int:
        """Stores the group; returns its bucket."""
        version = item.min_version
        entries = self._by_version.get(version)
        if entries is None:
            entries = self._by_version[version] = {}
            insort(self._versions, version)
        entries[self._seq] = item
        self._seq += 1
        tokens = item.num_tokens
        b = bisect_right(self.edges, tokens)
        self.bucket_groups[b] += 1
        self.bucket_tokens[b] += tokens
        self.groups += 1
        self.tokens += tokens
        return b

    def groups_up_to(self, version: int) -> int:
        """How many groups have ``min_version <= version``."""
        by_version = self._by_version
        return sum(len(by_version[v]) for v in itertools.takewhile(
            lambda v: v <= version, self._versions))

    def pop_older_than(self, version: int) -> list[T]:
        """Removes every group with ``min_version < version`` (the stale ones)."""
        out: list[T] = []
        while self._versions and self._versions[0] < version:
            out.extend(self._by_version.pop(self._versions.pop(0)).values())
        self._account_removed(out)
        return out

    def pop_oldest(self, n: int) -> list[T]:
        """Removes the ``n`` oldest groups (caller checks that ``n <= groups``)."""
        out: list[T] = []
        while len(out) < n:
            version = self._versions[0]
            entries = self._by_version[version]
            need = n - len(out)
            if len(entries) <= need:
                out.extend(entries.values())
                del self._by_version[version]
                self._versions.pop(0)
            else:
                for seq in list(itertools.islice(entries, need)):
                    out.append(entries.pop(seq))
        self._account_removed(out)
        return out

    def pop_homogeneous(self, n: int, urgent_below: int) -> list[T]:
        """Removes ``n`` groups of similar length, returned oldest first.

        First every group with ``min_version < urgent_below`` (oldest first, up to n),
        then the bucket of the oldest remaining group, then its neighbours by distance
        (the shorter one on a tie), each oldest first. The walk stops as soon as that
        bucket alone can complete the take, so it costs O(n / share of that bucket).
        """
        chosen = self._walk_homogeneous(n, urgent_below)
        chosen.sort()
        out = [self._by_version[v].pop(seq) for v, seq in chosen]
        for version in {v for v, _ in chosen}:
            if not self._by_version[version]:
                del self._by_version[version]
                self._versions.remove(version)
        self._account_removed(out)
        return out

    def _walk_homogeneous(self, n: int, urgent_below: int) -> list[tuple[int, int]]:
        chosen: list[tuple[int, int]] = []  # (version, seq)
        per_bucket: list[list[tuple[int, int]]] = [[] for _ in range(len(self.edges) + 1)]
        home = -1
        for version in self._versions:
            for seq, item in self._by_version[version].items():
                if version < urgent_below:
                    chosen.append((version, seq))
                    if len(chosen) == n:
                        return chosen
                    continue
                b = bisect_right(self.edges, item.num_tokens)
                if home < 0:
                    home = b  # the oldest group not yet chosen
                per_bucket[b].append((version, seq))
                if b == home and len(per_bucket[b]) == n - len(chosen):
                    return chosen + per_bucket[b]
        for b in sorted(range(len(per_bucket)), key=lambda b: (abs(b - home), b)):
            chosen.extend(per_bucket[b][: n - len(chosen)])
            if len(chosen) == n:
                break
        return chosen

    def _account_removed(self, items: list[T]) -> None:
        if not items:
            return
        groups, tokens = self.bucket_groups, self.bucket_tokens
        if self.edges:
            total = 0
            for item in items:
                n = item.num_tokens
                b = bisect_right(self.edges, n)
                groups[b] -= 1
                tokens[b] -= n
                total += n
        else:
            # One bucket: skip the per-item bisect on the hot path.
            total = sum(item.num_tokens for item in items)
            groups[0] -= len(items)
            tokens[0] -= total
        self.groups -= len(items)
        self.tokens -= total
