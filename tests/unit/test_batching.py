"""From groups to per-shard micro-batches: sequences, advantages and the plan's layout."""

from __future__ import annotations

from collections import Counter
from itertools import count
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers import SequenceTooLong
from buffers.common.records import Group, Prompt, Sample, TrainSequence, make_group
from buffers.common.train_records import ShardBatch
from buffers.plan.advantages import group_advantages
from buffers.plan.batching import shard_batches
from workers.trainer.config import TrainerConfig

_ids = count()


def group(prompt_len: int, completion_lens: list[int], rewards: list[float]) -> Group:
    """A group whose every token id is unique, so a sequence is recognisable anywhere."""
    n = next(_ids)
    prompt = Prompt(prompt_id=f"p{n}", text=f"prompt {n}", answer="0")
    prompt_ids = tuple(1_000_000 * n + i for i in range(prompt_len))
    samples = tuple(
        Sample(
            token_ids=tuple(1_000_000 * n + 1000 * (k + 1) + i for i in range(length)),
            logprobs=tuple(-0.1 * (i + 1) for i in range(length)),
            versions=(n % 3,) * length,
            finish_reason="stop",
            text=f"sample {k}",
            reward=reward,
        )
        for k, (length, reward) in enumerate(zip(completion_lens, rewards, strict=True))
    )
    return make_group(prompt, prompt_ids, samples)


def trainer(num_shards: int, cap: int) -> TrainerConfig:
    return TrainerConfig(num_shards=num_shards, groups_per_step=num_shards,
                         micro_batch_tokens=cap)


Key = tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...], float]


def key(seq: TrainSequence) -> Key:
    """A sequence by value (its arrays as tuples), so sequences can be counted."""
    return (tuple(seq.prompt_token_ids.tolist()), tuple(seq.completion_token_ids.tolist()),
            tuple(seq.behaviour_logprobs.tolist()), seq.advantage)


def expected_sequences(groups: list[Group]) -> list[Key]:
    """Every sample of every group with its group-normalised advantage, by value."""
    out = []
    for g in groups:
        tokens = g.tokens
        for k, advantage in enumerate(group_advantages(g.rewards)):
            out.append(key(tokens.sequence(k, advantage)))
    return out


def laid_out(batch: ShardBatch) -> tuple[tuple[Key, ...], ...]:
    """A shard's micro-batches resolved in-process (``groups`` hold the tokens)."""
    return tuple(tuple(key(s) for s in mb) for mb in batch.sequences(batch.groups))


# -- groups and their tokens ------------------------------------------------------------


def test_a_group_is_metadata_and_its_tokens_are_arrays() -> None:
    g = group(3, [2, 4, 1], [1.0, 0.0, 0.5])
    assert g.prompt_length == 3
    assert g.completion_lengths == (2, 4, 1)
    assert g.sequence_lengths == (5, 7, 4)
    assert g.num_tokens == 3 * 3 + 7
    assert g.rewards == (1.0, 0.0, 0.5)
    assert g.min_version == g.max_version
    n = int(g.prompt.prompt_id[1:])
    seq = g.tokens.sequence(1, 0.25)
    assert seq.prompt_token_ids.tolist() == [1_000_000 * n + i for i in range(3)]
    assert seq.completion_token_ids.tolist() == [1_000_000 * n + 2000 + i for i in range(4)]
    assert seq.behaviour_logprobs.dtype == np.float32
    assert seq.behaviour_logprobs.tolist() == pytest.approx([-0.1 * (i + 1) for i in range(4)])
    assert seq.advantage == 0.25


def test_a_group_without_samples_is_refused() -> None:
    with pytest.raises(ValueError, match="no samples"):
        make_group(Prompt(prompt_id="x", text="x", answer="0"), (1, 2), ())


def test_advantages_are_normalised_within_each_group() -> None:
    groups = [group(3, [2, 4, 1], [1.0, 0.0, 0.5]), group(5, [3, 3], [0.0, 1.0])]
    (batch,), _ = shard_batches(groups, 1, trainer(1, 64), step=1)
    advantages = {k[1]: k[3] for mb in laid_out(batch) for k in mb}  # completion -> adv
    assert len(advantages) == 5
    first = [advantages[tuple(groups[0].tokens.sequence(k, 0).completion_token_ids.tolist())]
             for k in range(3)]
    second = [advantages[tuple(groups[1].tokens.sequence(k, 0).completion_token_ids.tolist())]
              for k in range(2)]
    assert sum(first) == pytest.approx(0.0, abs=1e-9)
    assert sum(second) == pytest.approx(0.0, abs=1e-9)
    assert first[0] > first[2] > first[1]


def test_a_group_with_equal_rewards_trains_with_zero_advantages() -> None:
    (batch,), _ = shard_batches([group(2, [1, 2, 3, 4], [1.0] * 4)], 1, trainer(1, 64), 1)
    assert [slot.advantage for mb in batch.micro_batches for slot in mb] == [0.0] * 4


# -- shard_batches ----------------------------------------------------------------------

group_st = st.tuples(
    st.integers(1, 20),  # prompt length
    st.lists(st.tuples(st.integers(1, 40), st.sampled_from([0.0, 0.5, 1.0])),
             min_size=2, max_size=8),
)


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(group_st, min_size=1, max_size=12),
    num_shards=st.integers(1, 4),
    cap=st.integers(60, 300),
    step=st.integers(0, 100),
)
def test_shard_batches_cover_every_sample_once_in_equal_capped_micro_batches(
    shapes: list[tuple[int, list[tuple[int, float]]]], num_shards: int, cap: int, step: int
) -> None:
    groups = [group(p, [n for n, _ in samples], [r for _, r in samples])
              for p, samples in shapes]
    batches, plan = shard_batches(groups, num_shards, trainer(num_shards, cap), step)

    assert len(batches) == num_shards
    assert all(b.step == step for b in batches)
    # Equal micro-batch counts, so DDP's collectives line up across shards.
    counts = {len(b.micro_batches) for b in batches}
    assert counts == {plan.num_micro_batches}
    # Every sample exactly once, with its group-normalised advantage.
    expected = expected_sequences(groups)
    assert Counter(s for b in batches for mb in laid_out(b) for s in mb) == Counter(expected)
    assert len(set(expected)) == len(expected)  # token ids are unique
    # The hard token cap holds for every micro-batch (prompt + completion tokens).
    for b in batches:
        for mb in laid_out(b):
            assert sum(len(p) + len(c) for p, c, *_ in mb) <= cap
    # The batches are the plan's layout, in the plan's order.
    for b, shard in zip(batches, plan.shards, strict=True):
        assert laid_out(b) == tuple(tuple(expected[i] for i in mb)
                                    for mb in shard.micro_batches)
        # A shard lists only the groups it trains on, each once.
        used = {slot.group for mb in b.micro_batches for slot in mb}
        assert used == set(range(len(b.groups)))
        assert len({id(g) for g in b.groups}) == len(b.groups)


def test_more_shards_than_samples_pads_with_empty_micro_batches() -> None:
    groups = [group(2, [3, 3], [0.0, 1.0])]
    batches, plan = shard_batches(groups, 4, trainer(4, 64), step=7)
    assert [len(b.micro_batches) for b in batches] == [1, 1, 1, 1]
    assert sum(1 for b in batches if b.micro_batches == ((),)) == 2
    assert plan.padding_micro_batches == 2


def test_sequence_over_the_cap_is_refused_not_truncated() -> None:
    groups = [group(10, [60, 2], [0.0, 1.0])]
    with pytest.raises(SequenceTooLong):
        shard_batches(groups, 1, trainer(1, 64), step=0)


# -- mini-batches and the advantage knob ----------------------------------------------


def test_mini_batches_are_consecutive_whole_groups_one_update_each() -> None:
    groups = [group(2, [3, 5, 2, 4], [0.0, 1.0, 0.0, 1.0]) for _ in range(4)]
    config = TrainerConfig(num_shards=2, groups_per_step=4, micro_batch_tokens=64,
                           mini_batches=2)
    batches, plan = shard_batches(groups, 2, config, step=3)
    assert len(plan.updates) == 2
    expected = expected_sequences(groups)
    first, second = set(expected[:8]), set(expected[8:])  # groups 0-1, then groups 2-3
    for b in batches:
        assert b.updates == plan.updates
        by_update = b.per_update(laid_out(b))
        assert all(s in first for mb in by_update[0] for s in mb)
        assert all(s in second for mb in by_update[1] for s in mb)
    assert Counter(s for b in batches for mb in laid_out(b) for s in mb) == Counter(expected)


def test_more_mini_batches_than_groups_makes_one_update_per_group() -> None:
    groups = [group(2, [3, 3], [0.0, 1.0])]
    config = TrainerConfig(groups_per_step=4, micro_batch_tokens=64, mini_batches=4)
    (batch,), plan = shard_batches(groups, 1, config, step=1)
    assert plan.updates == batch.updates == (1,)


def test_per_update_refuses_a_list_of_the_wrong_length() -> None:
    (batch,), _ = shard_batches([group(2, [3, 3], [0.0, 1.0])], 1, trainer(1, 64), 1)
    with pytest.raises(ValueError, match="micro-batches for updates"):
        batch.per_update([(), ()])


@pytest.mark.parametrize(("std", "expected"), [
    # rewards [0, 1, 1]: mean 2/3, deviations -2/3, 1/3, 1/3, squared sum 2/3.
    ("none", [-2 / 3, 1 / 3, 1 / 3]),
    # population std sqrt(2/9) = 0.4714: -1.4142, 0.7071, 0.7071
    ("population", [-1.414214, 0.707107, 0.707107]),
    # sample std sqrt(1/3) = 0.57735: -1.1547, 0.57735, 0.57735
    ("sample", [-1.154701, 0.577350, 0.577350]),
])
def test_advantage_std_reaches_the_slots(std: Any, expected: list[float]) -> None:
    config = TrainerConfig(groups_per_step=1, micro_batch_tokens=64, advantage_std=std)
    (batch,), _ = shard_batches([group(2, [1, 2, 3], [0.0, 1.0, 1.0])], 1, config, 1)
    by_sample = {slot.sample: slot.advantage for mb in batch.micro_batches for slot in mb}
    assert [by_sample[k] for k in range(3)] == pytest.approx(expected, abs=1e-5)
