"""Balancing: KK partition, FFD packing under a hard cap, and the per-step plan."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers import SequenceTooLong, StepPlan, pack, partition, plan_step, sequence_costs
from buffers.plan.partition import (
    greedy_labels,
    karmarkar_karp_labels,
    part_costs,
    refine_labels,
)

costs_st = st.lists(st.floats(0, 1e4, allow_nan=False), max_size=300)
lengths_st = st.lists(st.integers(1, 512), max_size=200)


def largest(costs: list[float], parts: tuple[tuple[int, ...], ...]) -> float:
    return max((sum(costs[i] for i in p) for p in parts), default=0.0)


# -- partition --------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(costs=costs_st, k=st.integers(1, 40), equal_size=st.booleans())
def test_every_item_is_in_exactly_one_part(costs: list[float], k: int, equal_size: bool) -> None:
    parts = partition(costs, k, equal_size)
    assert len(parts) == k
    assert sorted(itertools.chain.from_iterable(parts)) == list(range(len(costs)))
    if equal_size:
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1


@settings(max_examples=80, deadline=None)
@given(costs=costs_st, k=st.integers(1, 40), equal_size=st.booleans())
def test_never_worse_than_greedy(costs: list[float], k: int, equal_size: bool) -> None:
    c = np.asarray(costs, dtype=np.float64)
    greedy = part_costs(c, greedy_labels(c, k, equal_size), k).max() if costs else 0.0
    assert largest(costs, partition(costs, k, equal_size)) <= greedy * (1 + 1e-12)


@settings(max_examples=50, deadline=None)
@given(costs=costs_st.filter(bool), k=st.integers(1, 20), equal_size=st.booleans())
def test_refinement_never_raises_the_largest_part(
    costs: list[float], k: int, equal_size: bool
) -> None:
    c = np.asarray(costs, dtype=np.float64)
    start = karmarkar_karp_labels(c, k, equal_size)
    refined = refine_labels(c, start, k, equal_size)
    assert part_costs(c, refined, k).max() <= part_costs(c, start, k).max() * (1 + 1e-12)
    if equal_size:
        sizes = np.bincount(refined, minlength=k)
        assert sizes.max() - sizes.min() <= 1


def test_kk_beats_greedy_on_the_textbook_case() -> None:
    # Greedy: {8,5,4} {7,6} -> 17 vs 13. Differencing: 16 vs 14. Optimum: 15 vs 15.
    costs = [8.0, 7.0, 6.0, 5.0, 4.0]
    kk = karmarkar_karp_labels(np.asarray(costs), 2)
    assert part_costs(np.asarray(costs), kk, 2).max() <= 16
    assert largest(costs, partition(costs, 2)) == 15  # refinement reaches the optimum


def test_balances_a_large_lognormal_batch() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(600), 0.8, 8192), 8, 8192).round()
    costs = sequence_costs(lengths.astype(int).tolist(), a=1.0, b=1 / 4096)
    parts = partition(costs, 64)
    loads = [costs[list(p)].sum() for p in parts]
    assert max(loads) / np.mean(loads) <= 1.001


def test_more_parts_than_items_leaves_parts_empty() -> None:
    parts = partition([3.0, 1.0], 4)
    assert sorted(len(p) for p in parts) == [0, 0, 1, 1]
    assert partition([], 3) == ((), (), ())


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError):
        partition([1.0, -1.0], 2)
    with pytest.raises(ValueError):
        partition([float("nan")], 2)
    with pytest.raises(ValueError):
        partition([1.0], 0)


def test_cost_model() -> None:
    assert sequence_costs([10, 20], a=2.0, b=0.5).tolist() == [70.0, 240.0]


# -- pack -------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_st, cap=st.integers(512, 2048))
def test_pack_never_exceeds_the_cap_and_keeps_every_sequence(lengths: list[int], cap: int) -> None:
    bins = pack(lengths, cap)
    assert sorted(itertools.chain.from_iterable(bins)) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)
    assert all(b for b in bins)
    assert len(bins) >= -(-sum(lengths) // cap)


def test_pack_is_first_fit_decreasing() -> None:
    # Sorted: 7 6 5 4 3 2 -> bins [7 3] [6 4] [5 2]; first fit puts 3 with 7, not 6.
    lengths = [5, 7, 2, 4, 6, 3]
    bins = pack(lengths, 10)
    assert [[lengths[i] for i in b] for b in bins] == [[7, 3], [6, 4], [5, 2]]


def test_a_sequence_longer_than_the_cap_is_an_error() -> None:
    with pytest.raises(SequenceTooLong, match=r"sequence 1 has 11 tokens.*cap of 10"):
        pack([3, 11], 10)
    with pytest.raises(SequenceTooLong):
        plan_step([3, 11], 2, 10)


# -- plan_step --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    lengths=lengths_st,
    shards=st.integers(1, 8),
    cap=st.integers(512, 2048),
    b=st.sampled_from([0.0, 1 / 256]),
)
def test_plan_invariants(lengths: list[int], shards: int, cap: int, b: float) -> None:
    plan = plan_step(lengths, shards, cap, cost_a=1.0, cost_b=b)
    assert len(plan.shards) == shards
    counts = {len(s.micro_batches) for s in plan.shards}
    assert counts == {plan.num_micro_batches}
    flat = [i for s in plan.shards for mb in s.micro_batches for i in mb]
    assert sorted(flat) == list(range(len(lengths)))
    assert list(plan.permutation) == flat
    assert all(plan.permutation[p] == i for i, p in enumerate(plan.inverse))
    for shard in plan.shards:
        assert all(sum(lengths[i] for i in mb) <= cap for mb in shard.micro_batches)
        assert shard.micro_batch_tokens == tuple(
            sum(lengths[i] for i in mb) for mb in shard.micro_batches
        )
        # Padding only where the shard has fewer sequences than micro-steps.
        n_seq = sum(len(mb) for mb in shard.micro_batches)
        n_pad = sum(1 for mb in shard.micro_batches if not mb)
        assert n_pad == max(0, plan.num_micro_batches - n_seq)
    assert plan.imbalance >= 1.0 - 1e-9


def test_inverse_permutation_merges_results_back() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, 50).tolist()
    plan = plan_step(lengths, 4, 600)
    # Each shard returns one value per sequence in its own order; concatenated, they are
    # in plan order, and `inverse` puts them back in input order.
    gathered = [f"out{i}" for i in plan.permutation]
    assert [gathered[p] for p in plan.inverse] == [f"out{i}" for i in range(50)]


def test_equal_micro_batch_counts_and_even_micro_steps() -> None:
    rng = np.random.default_rng(2)
    lengths = np.clip(rng.lognormal(np.log(600), 0.8, 2048), 8, 4096).astype(int).tolist()
    plan = plan_step(lengths, 4, 8192, cost_a=1.0, cost_b=1 / 4096)
    assert plan.padding_micro_batches == 0
    assert plan.imbalance < 1.001
    assert plan.micro_step_imbalance < 1.05


def test_padding_only_when_a_shard_has_too_few_sequences() -> None:
    # Shard costs 1400 / 1600: {1000, 400} needs two micro-batches, and so does
    # {400 x 4}; no padding.
    plan = plan_step([1000, 400, 400, 400, 400, 400], 2, 1000)
    assert (plan.num_micro_batches, plan.padding_micro_batches) == (2, 0)
    # Two sequences over four shards: two shards have nothing, so they pad.
    assert plan_step([100, 100], 4, 1000).padding_micro_batches == 2
    # A shard with fewer micro-batches than another splits its bins instead of padding.
    plan = plan_step([100] * 16, 2, 1000)
    assert plan.padding_micro_batches == 0


def test_plan_is_a_frozen_record_that_round_trips() -> None:
    plan = plan_step([5, 6, 7], 2, 10)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan) == plan
    with pytest.raises(AttributeError):
        plan.imbalance = 0.0  # type: ignore[misc]
    empty = plan_step([], 3, 10)
    assert empty.num_micro_batches == 0 and empty.permutation == ()


# -- updates: a step cut into optimizer updates -----------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    lengths=lengths_st,
    shards=st.integers(1, 4),
    cap=st.integers(512, 2048),
    cuts=st.lists(st.integers(0, 200), max_size=3),
)
def test_each_update_is_planned_alone_with_equal_counts_on_every_shard(
    lengths: list[int], shards: int, cap: int, cuts: list[int]
) -> None:
    cut = sorted({0, len(lengths), *(min(c, len(lengths)) for c in cuts)})
    updates = [hi - lo for lo, hi in itertools.pairwise(cut)] or [0]
    bounds = [0, *itertools.accumulate(updates)]
    plan = plan_step(lengths, shards, cap, updates=updates)
    assert len(plan.updates) == len(updates)
    assert sum(plan.updates) == plan.num_micro_batches
    assert {len(s.micro_batches) for s in plan.shards} == {plan.num_micro_batches}
    assert sorted(plan.permutation) == list(range(len(lengths)))
    ends = list(itertools.accumulate(plan.updates))
    for shard in plan.shards:
        for u, (end, count) in enumerate(zip(ends, plan.updates, strict=True)):
            # An update's micro-batches hold only its own sequences, under the cap.
            lo, hi = bounds[u], bounds[u + 1]
            for mb in shard.micro_batches[end - count : end]:
                assert all(lo <= i < hi for i in mb)
                assert sum(lengths[i] for i in mb) <= cap


def test_one_update_is_the_whole_step() -> None:
    lengths = [100, 300, 50, 700, 20, 20]
    assert plan_step(lengths, 2, 800, updates=[6]) == plan_step(lengths, 2, 800)
    assert plan_step(lengths, 2, 800).updates == (plan_step(lengths, 2, 800).num_micro_batches,)


def test_two_updates_keep_their_sequences_apart() -> None:
    # Four short sequences would share one micro-batch; cut in two updates, each update
    # gets its own micro-batch on the one shard.
    plan = plan_step([10, 10, 10, 10], 1, 100, updates=[2, 2])
    assert plan.updates == (1, 1)
    assert plan.shards[0].micro_batches == ((0, 1), (2, 3))


def test_updates_must_split_the_sequences() -> None:
    with pytest.raises(ValueError, match="do not split"):
        plan_step([10, 10, 10], 1, 100, updates=[2, 2])
