"""Balancing one training step: sequences to shards, and each shard's into micro-batches.

Owns: the cost model ``a*L + b*L^2``, first-fit-decreasing packing under a hard token
cap, and ``plan_step``, which turns the step's sequence lengths into a ``StepPlan``: per
shard, the same number of micro-batches (index tuples into the input) in each optimizer
update of the step, balanced cost per micro-step, and the permutation that merges
per-sample results back into input order. Knows nothing about groups, tensors or
trainers: it sees lengths only (metadata), so the plan is made before any data moves.
Splitting costs into parts is ``partition.py``'s.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import msgspec
import numpy as np

from buffers.plan.partition import FloatArray, partition
from buffers.queue.errors import SequenceTooLong

__all__ = ["ShardPlan", "StepPlan", "pack", "partition", "plan_step", "sequence_costs"]

_MAX_SKIPS = 16


class ShardPlan(msgspec.Struct, frozen=True, kw_only=True):
    """One shard's share of a step, in the order its micro-steps run."""

    micro_batches: tuple[tuple[int, ...], ...]
    """Indices into the step's sequence list; ``()`` is a padding micro-batch that the
    trainer runs with zero loss so every shard takes the same number of micro-steps."""
    micro_batch_tokens: tuple[int, ...]
    micro_batch_costs: tuple[float, ...]
    tokens: int
    cost: float


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Where every sequence of a step goes, and how even the result is."""

    shards: tuple[ShardPlan, ...]
    num_micro_batches: int
    """Micro-batches per shard (the same on every shard)."""
    updates: tuple[int, ...]
    """Micro-batches of each optimizer update, in order (the same on every shard)."""
    padding_micro_batches: int
    """Empty micro-batches over all shards (only when a shard has too few sequences)."""
    token_cap: int
    permutation: tuple[int, ...]
    """Input index at each position of the plan order (shard, micro-batch, sequence)."""
    inverse: tuple[int, ...]
    """Plan-order position of each input index: ``merged[i] = gathered[inverse[i]]``."""
    imbalance: float
    """Max shard cost / mean shard cost (1.0 is perfect)."""
    micro_step_imbalance: float
    """Sum over micro-steps of the max shard cost / sum of the mean: what per-micro-step
    barriers (FSDP) cost, 1.0 is perfect."""


def sequence_costs(lengths: Sequence[int], a: float = 1.0, b: float = 0.0) -> FloatArray:
    """Cost of each sequence: ``a*L`` for the MLPs and ``b*L^2`` for attention."""
    length = np.asarray(lengths, dtype=np.float64)
    return a * length + b * length * length


def pack(lengths: Sequence[int], cap: int) -> tuple[tuple[int, ...], ...]:
    """First-fit-decreasing: sequences into micro-batches whose token sum is <= ``cap``.

    Returns index tuples, the largest-first micro-batch first. The cap is never exceeded;
    a sequence longer than ``cap`` raises ``SequenceTooLong``. A max segment tree over
    the bins' free room finds the first bin that fits in O(log n), so 64k sequences pack
    in a fraction of a second in pure Python.
    """
    sizes = [int(x) for x in lengths]
    _check_lengths(sizes, cap)
    n = len(sizes)
    if n == 0:
        return ()
    leaves = 1
    while leaves < n:
        leaves *= 2
    # Every leaf starts with a full bin's room, so "first fit" opens a new bin by itself.
    room = [cap] * (2 * leaves)
    bins: list[list[int]] = []
    for i in sorted(range(n), key=lambda j: -sizes[j]):
        size, node = sizes[i], 1
        while node < leaves:
            node = 2 * node if room[2 * node] >= size else 2 * node + 1
        leaf = node - leaves
        if leaf == len(bins):
            bins.append([])
        bins[leaf].append(i)
        room[node] -= size
        node //= 2
        while node and room[node] != max(room[2 * node], room[2 * node + 1]):
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return tuple(tuple(b) for b in bins)


def plan_step(
    lengths: Sequence[int],
    num_shards: int,
    cap: int,
    *,
    cost_a: float = 1.0,
    cost_b: float = 0.0,
    updates: Sequence[int] = (),
) -> StepPlan:
    """Plans a step: KK over shards on cost, then equal-count, cap-bounded micro-batches.

    ``updates``: how many consecutive sequences each optimizer update of the step takes
    (they sum to ``len(lengths)``); empty is one update of them all. Each update is
    planned on its own, as follows, and its micro-batches come after the previous
    update's on every shard, so every shard has the same micro-batches per update.

    1. ``partition`` splits the sequences over ``num_shards`` by cost (sizes may differ).
    2. FFD packs each shard under ``cap`` tokens; the largest count M is the update's
       micro-batch count (no shard can do with fewer).
    3. Each shard's sequences are spread over exactly M micro-batches, greedy by cost
       under the cap, so micro-batches of a shard cost about the same; when that greedy
       spread cannot fit the cap, the FFD bins are split instead. A shard with fewer
       than M sequences gets empty padding micro-batches: the only case they appear.
    4. Micro-batches run heaviest first on every shard, so micro-step j pairs similar
       costs across shards.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: must be >= 1")
    sizes = [int(x) for x in lengths]
    _check_lengths(sizes, cap)
    counts = list(updates) or [len(sizes)]
    if sum(counts) != len(sizes) or min(counts) < 0:
        raise ValueError(f"updates {counts} do not split {len(sizes)} sequences")
    costs = sequence_costs(sizes, cost_a, cost_b).tolist()
    per_shard: list[list[tuple[int, ...]]] = [[] for _ in range(num_shards)]
    update_micro_batches = []
    for end, count in zip(itertools.accumulate(counts), counts, strict=True):
        planned = _plan_update(range(end - count, end), sizes, costs, num_shards, cap)
        update_micro_batches.append(len(planned[0]))
        for shard, mbs in zip(per_shard, planned, strict=True):
            shard.extend(mbs)
    shards = []
    for micro_batches in per_shard:
        mb_tokens = tuple(sum(sizes[i] for i in mb) for mb in micro_batches)
        mb_costs = tuple(sum(costs[i] for i in mb) for mb in micro_batches)
        shards.append(
            ShardPlan(
                micro_batches=tuple(micro_batches),
                micro_batch_tokens=mb_tokens,
                micro_batch_costs=mb_costs,
                tokens=sum(mb_tokens),
                cost=sum(mb_costs),
            )
        )
    permutation = tuple(i for shard in shards for mb in shard.micro_batches for i in mb)
    inverse = [0] * len(sizes)
    for position, i in enumerate(permutation):
        inverse[i] = position
    shard_costs = [s.cost for s in shards]
    mean = sum(shard_costs) / num_shards
    m = sum(update_micro_batches)
    step_max = sum(max(s.micro_batch_costs[j] for s in shards) for j in range(m))
    return StepPlan(
        shards=tuple(shards),
        num_micro_batches=m,
        updates=tuple(update_micro_batches),
        padding_micro_batches=sum(len(s.micro_batches) - len(_nonempty(s)) for s in shards),
        token_cap=cap,
        permutation=permutation,
        inverse=tuple(inverse),
        imbalance=max(shard_costs) / mean if mean > 0 else 1.0,
        micro_step_imbalance=step_max / mean if mean > 0 else 1.0,
    )


def _plan_update(
    indices: Sequence[int], sizes: list[int], costs: list[float], num_shards: int, cap: int
) -> list[tuple[tuple[int, ...], ...]]:
    """Steps 1-4 of ``plan_step`` for the sequences ``indices``: each shard's
    micro-batches, the same number on every shard."""
    local = partition([costs[i] for i in indices], num_shards) if indices else (
        ((),) * num_shards)
    parts = [[indices[j] for j in part] for part in local]
    ffd = [pack([sizes[i] for i in part], cap) for part in parts]
    m = max(len(bins) for bins in ffd)
    planned = []
    for part, bins in zip(parts, ffd, strict=True):
        spread = _spread(part, sizes, costs, m, cap)
        if spread is None:
            spread = _split_to(m, [[part[j] for j in mb] for mb in bins], costs)
        spread.sort(key=lambda mb: -sum(costs[i] for i in mb))
        planned.append(tuple(tuple(sorted(mb)) for mb in spread) + ((),) * (m - len(spread)))
    return planned


def _nonempty(shard: ShardPlan) -> list[tuple[int, ...]]:
    return [mb for mb in shard.micro_batches if mb]


def _check_lengths(sizes: list[int], cap: int) -> None:
    if cap < 1:
        raise ValueError(f"token cap={cap}: must be >= 1")
    for i, size in enumerate(sizes):
        if size > cap:
            raise SequenceTooLong(
                f"sequence {i} has {size} tokens, more than the micro-batch cap of {cap}: "
                f"raise the token cap to at least {size} or lower the maximum sequence length"
            )
        if size < 0:
            raise ValueError(f"sequence {i} has a negative length ({size})")


def _spread(
    part: Sequence[int], sizes: list[int], costs: list[float], m: int, cap: int
) -> list[list[int]] | None:
    """Greedy by cost into exactly ``min(m, len(part))`` bins under ``cap``; None if a
    sequence fits in no bin (FFD found m bins enough, but greedy can pack worse)."""
    count = min(m, len(part))
    if count == 0:
        return []
    bins: list[list[int]] = [[] for _ in range(count)]
    tokens = [0] * count
    heap = [(0.0, j) for j in range(count)]
    for i in sorted(part, key=lambda i: -costs[i]):
        skipped = []
        while heap and tokens[heap[0][1]] + sizes[i] > cap:
            skipped.append(heapq.heappop(heap))
            if len(skipped) > _MAX_SKIPS:
                return None  # bins this full are FFD's job; searching on is O(n * m)
        if not heap:
            return None
        load, j = heapq.heappop(heap)
        bins[j].append(i)
        tokens[j] += sizes[i]
        heapq.heappush(heap, (load + costs[i], j))
        for entry in skipped:
            heapq.heappush(heap, entry)
    if any(not mb for mb in bins):
        return None
    return bins


def _split_to(m: int, bins: list[list[int]], costs: list[float]) -> list[list[int]]:
    """Splits the costliest splittable bin in two (halves by cost) until there are m."""
    while len(bins) < m:
        splittable = [mb for mb in bins if len(mb) > 1]
        if not splittable:
            break  # fewer sequences than micro-steps: the caller pads
        mb = max(splittable, key=lambda mb: sum(costs[i] for i in mb))
        bins.remove(mb)
        halves: list[list[int]] = [[], []]
        loads = [0.0, 0.0]
        for i in sorted(mb, key=lambda i: -costs[i]):
            j = 0 if loads[0] <= loads[1] else 1
            if not halves[1 - j] and len(halves[j]) == len(mb) - 1:
                j = 1 - j  # keep both halves non-empty
            halves[j].append(i)
            loads[j] += costs[i]
        bins.extend(halves)
    return bins
