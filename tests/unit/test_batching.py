"""From groups to per-shard micro-batches: sequences, advantages and the plan's layout."""

from __future__ import annotations

from collections import Counter
from itertools import count

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.batching import shard_batches, training_sequences
from async_rl.config import TrainerConfig
from async_rl.grpo import group_advantages
from async_rl.records import Group, Prompt, Sample, TrainSequence, make_group
from buffers import SequenceTooLong

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


def key(seq: TrainSequence) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return seq.prompt_token_ids, seq.completion_token_ids


# -- training_sequences -----------------------------------------------------------------


def test_one_sequence_per_sample_with_the_groups_advantages() -> None:
    groups = [group(3, [2, 4, 1], [1.0, 0.0, 0.5]), group(5, [3, 3], [0.0, 1.0])]
    sequences = training_sequences(groups)
    assert len(sequences) == 5
    i = 0
    for g in groups:
        advantages = group_advantages(g.rewards)
        for sample, advantage in zip(g.samples, advantages, strict=True):
            seq = sequences[i]
            assert seq.prompt_token_ids == g.prompt_token_ids
            assert seq.completion_token_ids == sample.token_ids
            assert seq.behaviour_logprobs == sample.logprobs
            assert seq.advantage == advantage
            i += 1
    # Advantages are normalised within each group, not across the step.
    assert sum(s.advantage for s in sequences[:3]) == pytest.approx(0.0, abs=1e-9)
    assert sum(s.advantage for s in sequences[3:]) == pytest.approx(0.0, abs=1e-9)
    assert sequences[0].advantage > sequences[2].advantage > sequences[1].advantage


def test_a_group_with_equal_rewards_trains_with_zero_advantages() -> None:
    sequences = training_sequences([group(2, [1, 2, 3, 4], [1.0] * 4)])
    assert [s.advantage for s in sequences] == [0.0] * 4


def test_no_groups_no_sequences() -> None:
    assert training_sequences([]) == []


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
    # Every sample exactly once, with the advantage training_sequences gave it.
    expected = Counter(training_sequences(groups))
    laid_out = Counter(s for b in batches for mb in b.micro_batches for s in mb)
    assert laid_out == expected
    assert len({key(s) for s in laid_out}) == len(expected)  # token ids are unique
    # The hard token cap holds for every micro-batch (prompt + completion tokens).
    for b in batches:
        for mb in b.micro_batches:
            tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in mb)
            assert tokens <= cap
    # The batches are the plan's layout, in the plan's order.
    flat = training_sequences(groups)
    for b, shard in zip(batches, plan.shards, strict=True):
        assert b.micro_batches == tuple(tuple(flat[i] for i in mb) for mb in shard.micro_batches)


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
