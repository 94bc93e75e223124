"""GRPO math: group advantages, the two token-loss forms, normalisation and statistics.

Hand-computed values on tiny tensors (float64, so equalities are tight); no model.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.grpo import group_advantages, merge_stats, summarise, token_loss
from async_rl.records import LossStats

CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def loss_of(
    ratios: list[float],
    advantages: list[float],
    *,
    tis_cap: float,
    global_tokens: int | None = None,
) -> tuple[torch.Tensor, LossStats, torch.Tensor]:
    """Loss, stats and d loss / d logprobs for tokens whose pi_theta / pi_behaviour are
    ``ratios`` (behaviour logprobs fixed at log 0.5, so the ratio is set by logprobs)."""
    behaviour = torch.full((len(ratios),), math.log(0.5), dtype=torch.float64)
    logprobs = (behaviour + torch.log(torch.tensor(ratios, dtype=torch.float64)))
    logprobs = logprobs.detach().requires_grad_(True)
    loss, stats = token_loss(
        logprobs,
        behaviour,
        torch.tensor(advantages, dtype=torch.float64),
        global_tokens=len(ratios) if global_tokens is None else global_tokens,
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
        tis_cap=tis_cap,
    )
    loss.backward()
    assert logprobs.grad is not None
    return loss.detach(), stats, logprobs.grad


# -- group_advantages --------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(rewards=st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=64))
def test_advantages_have_zero_mean_and_unit_std(rewards: list[float]) -> None:
    advantages = group_advantages(rewards)
    assert len(advantages) == len(rewards)
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std < 1e-6:
        assert advantages == [0.0] * len(rewards)
        return
    a_mean = sum(advantages) / len(advantages)
    a_std = math.sqrt(sum((a - a_mean) ** 2 for a in advantages) / len(advantages))
    assert a_mean == pytest.approx(0.0, abs=1e-9)
    # (std + eps) in the denominator: unit std up to eps / std.
    assert a_std == pytest.approx(1.0, rel=1e-6 / std + 1e-9)


def test_advantages_keep_reward_order() -> None:
    advantages = group_advantages([0.0, 1.0, 1.0, 0.0])
    assert advantages == pytest.approx([-1.0, 1.0, 1.0, -1.0], abs=1e-5)


@pytest.mark.parametrize("rewards", [[1.0] * 8, [0.0, 0.0], [0.5]])
def test_all_equal_group_gets_zero_advantages(rewards: list[float]) -> None:
    assert group_advantages(rewards) == [0.0] * len(rewards)


def test_empty_group_gets_no_advantages() -> None:
    assert group_advantages([]) == []


# -- bypass form (tis_cap = 0): PPO-clip against the behaviour policy ---------------------

# ratio, advantage, per-token loss, d per-token / d logp, outside the clip range
# Clip range [0.8, 1.28]. The min picks the clipped (constant) term when the ratio has
# moved past the range in the direction the advantage pushes it: no gradient there.
BYPASS = [
    (1.1, 1.0, -1.1, -1.1, False),  # inside: -ratio * A
    (1.5, 1.0, -1.28, 0.0, True),  # A > 0, ratio above 1 + clip_high: clipped, no grad
    (0.5, 1.0, -0.5, -0.5, True),  # A > 0, ratio below 1 - clip_low: unclipped term wins
    (0.5, -1.0, 0.8, 0.0, True),  # A < 0, ratio below 1 - clip_low: clipped, no grad
    (1.5, -1.0, 1.5, 1.5, True),  # A < 0, ratio above 1 + clip_high: unclipped term wins
    (1.0, 0.0, 0.0, 0.0, False),  # zero advantage: no loss, no gradient
]


def test_bypass_loss_matches_hand_computed_ppo_clip() -> None:
    ratios = [r for r, *_ in BYPASS]
    advantages = [a for _, a, *_ in BYPASS]
    loss, stats, grad = loss_of(ratios, advantages, tis_cap=0.0)
    n = len(BYPASS)
    expected = [loss for _, _, loss, _, _ in BYPASS]
    assert float(loss) == pytest.approx(sum(expected) / n, abs=1e-12)
    assert stats.loss_sum == pytest.approx(sum(expected), abs=1e-12)
    assert stats.tokens == n
    # d(-ratio * A) / d logp = -ratio * A (ratio = exp(logp - behaviour)).
    assert grad.tolist() == pytest.approx([g / n for *_, g, _ in BYPASS], abs=1e-12)


def test_bypass_counts_tokens_outside_the_clip_range() -> None:
    ratios = [r for r, *_ in BYPASS]
    advantages = [a for _, a, *_ in BYPASS]
    _, stats, _ = loss_of(ratios, advantages, tis_cap=0.0)
    assert stats.clipped == sum(outside for *_, outside in BYPASS)
    summary = summarise(stats)
    assert summary["clip_fraction"] == pytest.approx(4 / len(BYPASS))


@pytest.mark.parametrize(
    ("ratio", "advantage"),
    [(1.0 + CLIP_HIGH + 0.01, 2.0), (3.0, 0.5), (1.0 - CLIP_LOW - 0.01, -2.0), (0.1, -0.5)],
)
def test_bypass_gradient_is_zero_when_clipped_on_the_wrong_side(
    ratio: float, advantage: float
) -> None:
    _, stats, grad = loss_of([ratio], [advantage], tis_cap=0.0)
    assert stats.clipped == 1
    assert grad.tolist() == [0.0]


def test_bypass_is_weights_are_the_untruncated_ratios() -> None:
    _, stats, _ = loss_of([0.5, 4.0], [1.0, 1.0], tis_cap=0.0)
    assert stats.is_weight_max == pytest.approx(4.0)
    assert stats.is_weight_sum == pytest.approx(4.5)
    assert stats.is_weight_sq_sum == pytest.approx(16.25)


# -- decoupled form (tis_cap > 0): truncated IS weight times the policy gradient ----------


def test_decoupled_weight_is_truncated_at_the_cap() -> None:
    ratios = [0.5, 1.5, 3.0, 1.0, 10.0]
    advantages = [1.0, -1.0, 2.0, 0.5, -1.0]
    cap = 2.0
    loss, stats, grad = loss_of(ratios, advantages, tis_cap=cap)
    n = len(ratios)
    weights = [min(r, cap) for r in ratios]
    assert weights == [0.5, 1.5, 2.0, 1.0, 2.0]
    # The proximal ratio pi_theta / sg(pi_theta) is 1 in value, so the loss is -w * A.
    expected = [-w * a for w, a in zip(weights, advantages, strict=True)]
    assert float(loss) == pytest.approx(sum(expected) / n, abs=1e-12)
    # ... and its gradient is -w * A * d logp: the weight is a detached constant.
    assert grad.tolist() == pytest.approx([e / n for e in expected], abs=1e-12)
    assert stats.is_weight_max == pytest.approx(cap)
    assert stats.is_weight_sum == pytest.approx(sum(weights))
    assert stats.is_weight_sq_sum == pytest.approx(sum(w * w for w in weights))


def test_decoupled_gradient_does_not_depend_on_the_clip_range() -> None:
    # Far outside [1 - clip_low, 1 + clip_high], yet below the cap: the full gradient.
    _, _, grad = loss_of([1.9], [1.0], tis_cap=2.0)
    assert grad.tolist() == pytest.approx([-1.9], abs=1e-12)


# -- normalisation by the global token count ---------------------------------------------

token_st = st.tuples(st.floats(0.05, 5.0), st.floats(-3.0, 3.0))


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(token_st, min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    tis_cap=st.sampled_from([0.0, 2.0]),
)
def test_split_losses_sum_to_the_single_batch_loss(
    tokens: list[tuple[float, float]], cuts: list[int], tis_cap: float
) -> None:
    ratios = [r for r, _ in tokens]
    advantages = [a for _, a in tokens]
    n = len(tokens)
    whole, whole_stats, whole_grad = loss_of(ratios, advantages, tis_cap=tis_cap)
    bounds = sorted({0, n, *(min(c, n) for c in cuts)})
    losses: list[float] = []
    parts: list[LossStats] = []
    grads: list[float] = []
    for lo, hi in itertools.pairwise(bounds):
        loss, stats, grad = loss_of(
            ratios[lo:hi], advantages[lo:hi], tis_cap=tis_cap, global_tokens=n
        )
        losses.append(float(loss))
        parts.append(stats)
        grads.extend(grad.tolist())
    assert sum(losses) == pytest.approx(float(whole), rel=1e-9, abs=1e-12)
    # Same per-token gradients, wherever the token landed: a short shard's tokens are not
    # up-weighted (as they would be with a per-shard mean).
    assert grads == pytest.approx(whole_grad.tolist(), rel=1e-9, abs=1e-12)
    merged = merge_stats(parts)
    assert merged.tokens == whole_stats.tokens
    assert merged.clipped == whole_stats.clipped
    assert merged.loss_sum == pytest.approx(whole_stats.loss_sum, rel=1e-9, abs=1e-12)
    assert merged.is_weight_sum == pytest.approx(whole_stats.is_weight_sum, rel=1e-9)
    assert merged.is_weight_sq_sum == pytest.approx(whole_stats.is_weight_sq_sum, rel=1e-9)
    assert merged.is_weight_max == whole_stats.is_weight_max
    assert merged.kl_sum == pytest.approx(whole_stats.kl_sum, rel=1e-9, abs=1e-12)


def test_short_shard_gets_the_same_per_token_gradient_as_a_long_one() -> None:
    # One shard holds a single token, the other nine; both divide by all ten tokens.
    _, _, short = loss_of([1.1], [1.0], tis_cap=0.0, global_tokens=10)
    _, _, long = loss_of([1.1] * 9, [1.0] * 9, tis_cap=0.0, global_tokens=10)
    assert short.tolist() == pytest.approx([long[0].item()])
    assert short.item() == pytest.approx(-1.1 / 10)


def test_empty_micro_batch_is_a_zero_loss_pad() -> None:
    empty = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    loss, stats = token_loss(
        empty, empty.detach(), empty.detach(), global_tokens=8,
        clip_low=CLIP_LOW, clip_high=CLIP_HIGH, tis_cap=2.0,
    )
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert stats.tokens == 0
    assert stats.is_weight_max == 0.0


# -- statistics -------------------------------------------------------------------------


@pytest.mark.parametrize("tis_cap", [0.0, 2.0])
def test_uniform_weights_have_unit_ess(tis_cap: float) -> None:
    _, stats, _ = loss_of([1.3] * 7, [1.0, -1.0, 0.5, 0.0, 2.0, -2.0, 1.0], tis_cap=tis_cap)
    summary = summarise(stats)
    assert summary["ess"] == pytest.approx(1.0)
    assert summary["is_weight_mean"] == pytest.approx(1.3)
    assert summary["is_weight_max"] == pytest.approx(1.3)


def test_uneven_weights_lower_the_ess() -> None:
    _, stats, _ = loss_of([0.5, 1.0, 1.5], [1.0, 1.0, 1.0], tis_cap=0.0)
    # (sum w)^2 / (n * sum w^2) = 9 / (3 * 3.5)
    assert summarise(stats)["ess"] == pytest.approx(9 / 10.5)


def test_merge_stats_adds_sums_and_takes_the_max_weight() -> None:
    a = LossStats(tokens=3, loss_sum=-1.0, clipped=1, is_weight_sum=3.0,
                  is_weight_sq_sum=3.5, is_weight_max=1.5, kl_sum=0.1)
    b = LossStats(tokens=2, loss_sum=0.5, clipped=0, is_weight_sum=2.0,
                  is_weight_sq_sum=2.0, is_weight_max=1.0, kl_sum=0.0)
    merged = merge_stats([a, b])
    assert merged == LossStats(tokens=5, loss_sum=-0.5, clipped=1, is_weight_sum=5.0,
                               is_weight_sq_sum=5.5, is_weight_max=1.5, kl_sum=0.1)
    summary = summarise(merged)
    assert summary["loss"] == pytest.approx(-0.1)
    assert summary["clip_fraction"] == pytest.approx(0.2)
    assert summary["is_weight_max"] == 1.5
    assert summary["ess"] == pytest.approx(25 / (5 * 5.5))


def test_merge_of_nothing_is_empty_and_summarises_without_dividing_by_zero() -> None:
    merged = merge_stats([])
    assert merged.tokens == 0
    assert summarise(merged) == {"loss": 0.0, "clip_fraction": 0.0, "is_weight_mean": 0.0,
                                 "is_weight_max": 0.0, "ess": 1.0, "kl_behaviour": 0.0}


def test_kl_is_zero_on_policy_and_positive_off_policy() -> None:
    _, on, _ = loss_of([1.0, 1.0], [1.0, -1.0], tis_cap=0.0)
    _, off, _ = loss_of([0.5, 1.7], [1.0, -1.0], tis_cap=0.0)
    assert on.kl_sum == pytest.approx(0.0, abs=1e-15)
    assert off.kl_sum > 0


def test_kl_is_an_unbiased_estimate_of_kl_behaviour_to_current() -> None:
    # Exact expectation over a 4-token vocabulary, tokens drawn from the behaviour policy.
    behaviour = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)
    current = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    _, stats_per_token = zip(
        *(
            token_loss(
                current[i : i + 1].log(), behaviour[i : i + 1].log(),
                torch.zeros(1, dtype=torch.float64), global_tokens=1,
                clip_low=CLIP_LOW, clip_high=CLIP_HIGH, tis_cap=0.0,
            )
            for i in range(4)
        ),
        strict=True,
    )
    expected = float((behaviour * (behaviour / current).log()).sum())
    estimate = sum(float(q) * s.kl_sum for q, s in zip(behaviour, stats_per_token, strict=True))
    assert estimate == pytest.approx(expected, rel=1e-9)
