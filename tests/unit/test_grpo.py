"""GRPO math: group advantages, the two token-loss forms, the knobs, normalisation and
statistics.

Hand-computed values on tiny tensors (float64, so equalities are tight); no model. The
cross-checks against reference implementations of AReaL's and verl's objectives are in
``test_loss_reference.py``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.control.loss_stats import merge_stats, summarise
from buffers.common.train_records import LossStats
from buffers.plan.advantages import group_advantages
from workers.trainer.config import TrainerConfig
from workers.trainer.loss import Normaliser, read_stats, token_loss

CLIP_LOW, CLIP_HIGH = 0.2, 0.28
HALF = math.log(0.5)


def loss_of(
    ratios: list[float],
    advantages: list[float],
    *,
    proximal: list[float] | None = None,
    lengths: list[int] | None = None,
    norm: Normaliser | None = None,
    **config: Any,
) -> tuple[torch.Tensor, LossStats, torch.Tensor]:
    """Loss, stats and d loss / d logprobs for tokens whose pi_theta / pi_behaviour are
    ``ratios`` (behaviour logprobs fixed at log 0.5, so the ratio is set by logprobs).

    ``proximal``: pi_prox / pi_behaviour per token (None: the current policy detached).
    ``lengths``: the sequences' token counts (default one sequence); ``norm`` defaults
    to the token mean over these tokens; ``config``: TrainerConfig fields.
    """
    behaviour = torch.full((len(ratios),), HALF, dtype=torch.float64)
    logprobs = (behaviour + torch.log(torch.tensor(ratios, dtype=torch.float64)))
    logprobs = logprobs.detach().requires_grad_(True)
    lengths = lengths or [len(ratios)]
    loss, stats = token_loss(
        logprobs,
        behaviour,
        torch.tensor(advantages, dtype=torch.float64),
        lengths=lengths,
        norm=norm or Normaliser(agg="token_mean", tokens=len(ratios), sequences=len(lengths)),
        config=TrainerConfig(**config),
        proximal_logprobs=None if proximal is None else (
            behaviour + torch.log(torch.tensor(proximal, dtype=torch.float64))),
    )
    loss.backward()
    assert logprobs.grad is not None
    return loss.detach(), read_stats([stats]), logprobs.grad


# -- group_advantages --------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(rewards=st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=64))
def test_advantages_have_zero_mean_and_unit_sample_std(rewards: list[float]) -> None:
    advantages = group_advantages(rewards)
    assert len(advantages) == len(rewards)
    n = len(rewards)
    mean = sum(rewards) / n
    if math.sqrt(sum((r - mean) ** 2 for r in rewards) / n) < 1e-6:
        assert advantages == [0.0] * n
        return
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    a_mean = sum(advantages) / n
    a_std = math.sqrt(sum((a - a_mean) ** 2 for a in advantages) / (n - 1))
    assert a_mean == pytest.approx(0.0, abs=1e-9)
    # (std + eps) in the denominator: unit std up to eps / std.
    assert a_std == pytest.approx(1.0, rel=1e-6 / std + 1e-9)


# [0, 1, 1, 0]: mean 0.5, deviations +-0.5, squared sum 1. Sample std sqrt(1/3) = 0.57735:
# +-0.5 / 0.57735 = +-0.866025; population std sqrt(1/4) = 0.5: +-1; none: +-0.5.
# [0, 1]: squared sum 0.5; sample std sqrt(0.5) = 0.70711: +-0.70711; population 0.5: +-1.
@pytest.mark.parametrize(
    ("std", "rewards", "expected"),
    [
        ("sample", [0.0, 1.0, 1.0, 0.0], [-0.866025, 0.866025, 0.866025, -0.866025]),
        ("population", [0.0, 1.0, 1.0, 0.0], [-1.0, 1.0, 1.0, -1.0]),
        ("none", [0.0, 1.0, 1.0, 0.0], [-0.5, 0.5, 0.5, -0.5]),
        ("sample", [0.0, 1.0], [-0.707107, 0.707107]),
        ("population", [0.0, 1.0], [-1.0, 1.0]),
        ("none", [2.0, 5.0, 8.0], [-3.0, 0.0, 3.0]),
    ],
)
def test_advantage_std_modes_match_hand_computed_values(
    std: Any, rewards: list[float], expected: list[float]
) -> None:
    assert group_advantages(rewards, std) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("std", ["sample", "population", "none"])
@pytest.mark.parametrize("rewards", [[1.0] * 8, [0.0, 0.0], [0.5], [0.1, 0.1, 0.1]])
def test_all_equal_group_gets_zero_advantages(std: Any, rewards: list[float]) -> None:
    # A group of one with "sample" included: n - 1 = 0 must not divide anything.
    assert group_advantages(rewards, std) == [0.0] * len(rewards)


def test_empty_group_gets_no_advantages() -> None:
    assert group_advantages([]) == []


# -- plain form (tis_cap = 0): PPO-clip against the behaviour policy ----------------------

# ratio, advantage, per-token loss, d per-token / d logp, clip binds, outside the band
# Clip range [0.8, 1.28]. The max (of losses) picks the clipped (constant) term when the
# ratio has moved past the range in the direction the advantage pushes it: no gradient.
PLAIN = [
    (1.1, 1.0, -1.1, -1.1, False, False),  # inside: -ratio * A
    (1.5, 1.0, -1.28, 0.0, True, True),  # A > 0, ratio above 1 + clip_high: clipped
    (0.5, 1.0, -0.5, -0.5, False, True),  # A > 0, below 1 - clip_low: unclipped wins
    (0.5, -1.0, 0.8, 0.0, True, True),  # A < 0, below 1 - clip_low: clipped, no grad
    (1.5, -1.0, 1.5, 1.5, False, True),  # A < 0, above 1 + clip_high: unclipped wins
    (1.0, 0.0, 0.0, 0.0, False, False),  # zero advantage: no loss, no gradient
]


def test_plain_loss_matches_hand_computed_ppo_clip() -> None:
    ratios = [r for r, *_ in PLAIN]
    advantages = [a for _, a, *_ in PLAIN]
    loss, stats, grad = loss_of(ratios, advantages, tis_cap=0.0)
    n = len(PLAIN)
    expected = [row[2] for row in PLAIN]
    assert float(loss) == pytest.approx(sum(expected) / n, abs=1e-12)
    assert stats.loss_sum == pytest.approx(sum(expected), abs=1e-12)
    assert stats.tokens == n
    # d(-ratio * A) / d logp = -ratio * A (ratio = exp(logp - behaviour)).
    assert grad.tolist() == pytest.approx([row[3] / n for row in PLAIN], abs=1e-12)


def test_clip_fraction_counts_binding_clips_and_the_band_counts_the_rest() -> None:
    ratios = [r for r, *_ in PLAIN]
    advantages = [a for _, a, *_ in PLAIN]
    _, stats, _ = loss_of(ratios, advantages, tis_cap=0.0)
    assert stats.clipped == sum(row[4] for row in PLAIN) == 2
    assert stats.out_of_band == sum(row[5] for row in PLAIN) == 4
    assert stats.dual_clipped == 0
    summary = summarise(stats)
    assert summary["clip_fraction"] == pytest.approx(2 / len(PLAIN))
    assert summary["is_out_of_band_fraction"] == pytest.approx(4 / len(PLAIN))


@pytest.mark.parametrize(
    ("ratio", "advantage"),
    [(1.0 + CLIP_HIGH + 0.01, 2.0), (2.5, 0.5), (1.0 - CLIP_LOW - 0.01, -2.0), (0.1, -0.5)],
)
def test_plain_gradient_is_zero_where_the_clip_binds(ratio: float, advantage: float) -> None:
    _, stats, grad = loss_of([ratio], [advantage], tis_cap=0.0)
    assert stats.clipped == 1
    assert grad.tolist() == [0.0]


def test_plain_is_weights_are_the_untruncated_ratios() -> None:
    _, stats, _ = loss_of([0.5, 4.0], [1.0, 1.0], tis_cap=0.0)
    assert stats.is_weight_max == pytest.approx(4.0)
    assert stats.is_weight_sum == pytest.approx(4.5)
    assert stats.is_weight_sq_sum == pytest.approx(16.25)


# -- dual-clip ---------------------------------------------------------------------------


def test_dual_clip_bounds_the_loss_of_negative_advantages() -> None:
    # A = -1, c = 3. Ratio 4: PPO loss max(4, 1.28) = 4 > 3 = -c * A: bounded to 3, no
    # gradient. Ratio 2: loss 2 < 3 stays, gradient -A * r = 2. A = +1, ratio 4: clipped
    # at 1.28 as usual (loss -1.28), the bound never applies to positive advantages.
    loss, stats, grad = loss_of([4.0, 2.0, 4.0], [-1.0, -1.0, 1.0], tis_cap=0.0)
    assert float(loss) == pytest.approx((3.0 + 2.0 - 1.28) / 3, abs=1e-12)
    assert grad.tolist() == pytest.approx([0.0, 2.0 / 3, 0.0], abs=1e-12)
    assert stats.dual_clipped == 1
    assert stats.clipped == 1
    assert summarise(stats)["dual_clip_fraction"] == pytest.approx(1 / 3)


def test_a_larger_dual_clip_bound_lets_the_loss_through() -> None:
    loss, stats, grad = loss_of([4.0], [-1.0], tis_cap=0.0, clip_ratio_c=10.0)
    assert float(loss) == pytest.approx(4.0)
    assert grad.tolist() == pytest.approx([4.0])
    assert stats.dual_clipped == 0


def test_dual_clip_applies_to_the_decoupled_ratio_too() -> None:
    # pi / pi_prox = 4 with A = -1: bounded to 3, times the weight pi_prox / pi_beh = 1.
    loss, stats, grad = loss_of([4.0], [-1.0], proximal=[1.0])
    assert float(loss) == pytest.approx(3.0)
    assert grad.tolist() == [0.0]
    assert stats.dual_clipped == 1


# -- decoupled form (tis_cap > 0) -------------------------------------------------------


def test_decoupled_single_update_weight_is_truncated_at_the_cap() -> None:
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
    assert stats.clipped == 0  # r = 1: the clip never binds on the first update


def test_decoupled_single_update_gradient_does_not_depend_on_the_clip_range() -> None:
    # Far outside [1 - clip_low, 1 + clip_high], yet below the cap: the full gradient.
    _, stats, grad = loss_of([1.9], [1.0], tis_cap=2.0)
    assert grad.tolist() == pytest.approx([-1.9], abs=1e-12)
    assert stats.out_of_band == 1 and stats.clipped == 0


def test_decoupled_clips_the_ratio_to_the_proximal_policy() -> None:
    # Behaviour weight w = pi_prox / pi_beh = 1.2 (below the cap), A = 1.
    # pi / pi_beh = 1.8: r = 1.8 / 1.2 = 1.5 > 1.28, clip binds: loss -1.2 * 1.28 = -1.536,
    # no gradient. pi / pi_beh = 1.32: r = 1.1, loss -1.2 * 1.1 = -1.32, gradient -1.32.
    loss, stats, grad = loss_of([1.8, 1.32], [1.0, 1.0], proximal=[1.2, 1.2])
    assert float(loss) == pytest.approx((-1.536 - 1.32) / 2, abs=1e-12)
    assert grad.tolist() == pytest.approx([0.0, -1.32 / 2], abs=1e-12)
    assert stats.clipped == 1
    assert stats.is_weight_sum == pytest.approx(2.4)


# -- tis_mode ----------------------------------------------------------------------------


def test_tis_mode_truncate_caps_and_mask_drops_the_weight() -> None:
    # Behaviour weights 0.5, 1.5, 3.0 (single update: w = pi / pi_beh), A = 1, cap 2.
    # truncate: w = 0.5, 1.5, 2.0 -> loss -(0.5 + 1.5 + 2) / 3 = -4/3, grad -w / 3.
    # mask: w = 0.5, 1.5, 0 -> loss -(0.5 + 1.5) / 3 = -2/3, the third token gives nothing
    # but still counts in the token mean's denominator (as AReaL's loss_mask does).
    ratios, advantages = [0.5, 1.5, 3.0], [1.0, 1.0, 1.0]
    loss, stats, grad = loss_of(ratios, advantages, tis_mode="truncate")
    assert float(loss) == pytest.approx(-4 / 3, abs=1e-12)
    assert grad.tolist() == pytest.approx([-0.5 / 3, -1.5 / 3, -2.0 / 3], abs=1e-12)
    loss, stats, grad = loss_of(ratios, advantages, tis_mode="mask")
    assert float(loss) == pytest.approx(-2 / 3, abs=1e-12)
    assert grad.tolist() == pytest.approx([-0.5 / 3, -1.5 / 3, 0.0], abs=1e-12)
    assert stats.is_weight_sum == pytest.approx(2.0)
    assert stats.is_weight_max == pytest.approx(1.5)


def test_a_weight_exactly_at_the_cap_is_kept_by_mask() -> None:
    _, _, grad = loss_of([2.0], [1.0], tis_mode="mask", tis_cap=2.0)
    assert grad.tolist() == pytest.approx([-2.0])


# -- loss_agg ---------------------------------------------------------------------------

# Two sequences, lengths 1 and 3, on-policy (w = 1, r = 1): per-token losses -A.
# Sequence 1: A = 2 -> [-2]; sequence 2: A = -1 -> [1, 1, 1].
# token_mean:              (-2 + 3) / 4 tokens                   = 0.25
# seq_mean_token_mean:     (-2 / 1 + 3 / 3) / 2 sequences        = -0.5
# seq_mean_token_sum_norm: (-2 / 4 + 3 / 4) / 2, max response 4  = 0.125
# Gradients: -A times each token's weight in that sum.
AGG_CASES = [
    ("token_mean", 0.25, [-2 / 4, 1 / 4, 1 / 4, 1 / 4]),
    ("seq_mean_token_mean", -0.5, [-2 / 2, 1 / 6, 1 / 6, 1 / 6]),
    ("seq_mean_token_sum_norm", 0.125, [-2 / 8, 1 / 8, 1 / 8, 1 / 8]),
]


@pytest.mark.parametrize(("agg", "expected_loss", "expected_grad"), AGG_CASES)
def test_loss_agg_modes_match_hand_computed_values(
    agg: Any, expected_loss: float, expected_grad: list[float]
) -> None:
    norm = Normaliser(agg=agg, tokens=4, sequences=2, max_response_tokens=4)
    loss, stats, grad = loss_of([1.0] * 4, [2.0, -1.0, -1.0, -1.0], lengths=[1, 3],
                                norm=norm, loss_agg=agg)
    assert float(loss) == pytest.approx(expected_loss, abs=1e-12)
    assert grad.tolist() == pytest.approx(expected_grad, abs=1e-12)
    assert stats.loss_sum == pytest.approx(1.0)  # the statistic is the plain token sum


sequence_st = st.tuples(st.integers(0, 6), st.floats(-3.0, 3.0))


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(sequence_st, min_size=1, max_size=12),
    cuts=st.lists(st.integers(0, 12), max_size=4),
    agg=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]),
    tis_cap=st.sampled_from([0.0, 2.0]),
    data=st.data(),
)
def test_micro_batch_losses_sum_to_the_update_loss(
    seqs: list[tuple[int, float]], cuts: list[int], agg: Any, tis_cap: float,
    data: st.DataObject,
) -> None:
    lengths = [n for n, _ in seqs]
    advantages = [a for n, a in seqs for _ in range(n)]
    ratios = data.draw(st.lists(st.floats(0.05, 5.0), min_size=len(advantages),
                                max_size=len(advantages)))
    norm = Normaliser(agg=agg, tokens=len(ratios), sequences=len(seqs),
                      max_response_tokens=6)
    config = {"tis_cap": tis_cap, "loss_agg": agg}
    whole, whole_stats, whole_grad = loss_of(ratios, advantages, lengths=lengths, norm=norm,
                                             **config)
    starts = [0, *itertools.accumulate(lengths)]  # token offset of each sequence
    bounds = sorted({0, len(seqs), *(min(c, len(seqs)) for c in cuts)})
    losses: list[float] = []
    parts: list[LossStats] = []
    grads: list[float] = []
    for lo, hi in itertools.pairwise(bounds):
        tokens = slice(starts[lo], starts[hi])
        loss, stats, grad = loss_of(ratios[tokens], advantages[tokens],
                                    lengths=lengths[lo:hi], norm=norm, **config)
        losses.append(float(loss))
        parts.append(stats)
        grads.extend(grad.tolist())
    assert sum(losses) == pytest.approx(float(whole), rel=1e-9, abs=1e-12)
    # Same per-token gradients, wherever the sequence landed: a short shard's tokens are
    # not up-weighted (as they would be with a per-shard mean).
    assert grads == pytest.approx(whole_grad.tolist(), rel=1e-9, abs=1e-12)
    merged = merge_stats(parts)
    assert merged.tokens == whole_stats.tokens
    assert merged.clipped == whole_stats.clipped
    assert merged.out_of_band == whole_stats.out_of_band
    assert merged.loss_sum == pytest.approx(whole_stats.loss_sum, rel=1e-9, abs=1e-12)
    assert merged.is_weight_sum == pytest.approx(whole_stats.is_weight_sum, rel=1e-9)
    assert merged.is_weight_sq_sum == pytest.approx(whole_stats.is_weight_sq_sum, rel=1e-9)
    assert merged.is_weight_max == whole_stats.is_weight_max
    assert merged.kl_sum == pytest.approx(whole_stats.kl_sum, rel=1e-9, abs=1e-12)


def test_short_shard_gets_the_same_per_token_gradient_as_a_long_one() -> None:
    # One shard holds a single token, the other nine; both divide by all ten tokens.
    norm = Normaliser(agg="token_mean", tokens=10, sequences=2)
    _, _, short = loss_of([1.1], [1.0], tis_cap=0.0, norm=norm)
    _, _, long = loss_of([1.1] * 9, [1.0] * 9, tis_cap=0.0, norm=norm)
    assert short.tolist() == pytest.approx([long[0].item()])
    assert short.item() == pytest.approx(-1.1 / 10)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_empty_micro_batch_is_a_zero_loss_pad(agg: Any) -> None:
    empty = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    loss, stats = token_loss(
        empty, empty.detach(), empty.detach(), lengths=[],
        norm=Normaliser(agg=agg, tokens=8, sequences=2), config=TrainerConfig(),
    )
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert stats.tokens == 0 and stats.values.device == empty.device
    assert read_stats([stats]) == LossStats()


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


def test_entropy_is_summed_per_token_and_averaged_in_the_summary() -> None:
    logprobs = torch.full((2,), HALF, dtype=torch.float64)
    _, stats = token_loss(logprobs, logprobs, torch.ones(2, dtype=torch.float64), lengths=[2],
                          norm=Normaliser(agg="token_mean", tokens=2, sequences=1),
                          config=TrainerConfig(),
                          entropy=torch.tensor([0.5, 1.5], dtype=torch.float64))
    read = read_stats([stats])
    assert read.entropy_sum == pytest.approx(2.0)
    assert summarise(read)["entropy"] == pytest.approx(1.0)


def test_merge_stats_adds_sums_and_takes_the_max_weight() -> None:
    a = LossStats(tokens=3, loss_sum=-1.0, clipped=1, dual_clipped=1, out_of_band=2,
                  is_weight_sum=3.0, is_weight_sq_sum=3.5, is_weight_max=1.5, kl_sum=0.1,
                  entropy_sum=1.0)
    b = LossStats(tokens=2, loss_sum=0.5, clipped=0, out_of_band=1, is_weight_sum=2.0,
                  is_weight_sq_sum=2.0, is_weight_max=1.0, entropy_sum=2.0)
    merged = merge_stats([a, b])
    assert merged == LossStats(tokens=5, loss_sum=-0.5, clipped=1, dual_clipped=1,
                               out_of_band=3, is_weight_sum=5.0, is_weight_sq_sum=5.5,
                               is_weight_max=1.5, kl_sum=0.1, entropy_sum=3.0)
    summary = summarise(merged)
    assert summary["loss"] == pytest.approx(-0.1)
    assert summary["clip_fraction"] == pytest.approx(0.2)
    assert summary["dual_clip_fraction"] == pytest.approx(0.2)
    assert summary["is_out_of_band_fraction"] == pytest.approx(0.6)
    assert summary["is_weight_max"] == 1.5
    assert summary["ess"] == pytest.approx(25 / (5 * 5.5))
    assert summary["entropy"] == pytest.approx(0.6)


def test_merge_of_nothing_is_empty_and_summarises_without_dividing_by_zero() -> None:
    merged = merge_stats([])
    assert merged == LossStats()
    assert summarise(merged) == {
        "loss": 0.0, "clip_fraction": 0.0, "dual_clip_fraction": 0.0,
        "is_out_of_band_fraction": 0.0, "is_weight_mean": 0.0, "is_weight_max": 0.0,
        "ess": 1.0, "kl_behaviour": 0.0, "entropy": 0.0}


def test_kl_is_zero_on_policy_and_positive_off_policy() -> None:
    _, on, _ = loss_of([1.0, 1.0], [1.0, -1.0], tis_cap=0.0)
    _, off, _ = loss_of([0.5, 1.7], [1.0, -1.0], tis_cap=0.0)
    assert on.kl_sum == pytest.approx(0.0, abs=1e-15)
    assert off.kl_sum > 0


def test_kl_is_an_unbiased_estimate_of_kl_behaviour_to_current() -> None:
    # Exact expectation over a 4-token vocabulary, tokens drawn from the behaviour policy.
    behaviour = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)
    current = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    norm = Normaliser(agg="token_mean", tokens=1, sequences=1)
    _, stats_per_token = zip(
        *(
            token_loss(
                current[i : i + 1].log(), behaviour[i : i + 1].log(),
                torch.zeros(1, dtype=torch.float64), lengths=[1], norm=norm,
                config=TrainerConfig(tis_cap=0.0),
            )
            for i in range(4)
        ),
        strict=True,
    )
    expected = float((behaviour * (behaviour / current).log()).sum())
    estimate = sum(float(q) * read_stats([s]).kl_sum
                   for q, s in zip(behaviour, stats_per_token, strict=True))
    assert estimate == pytest.approx(expected, rel=1e-9)
