"""The KL estimators and GAE against reference implementations of verl's.

``verl_kl_penalty`` and ``verl_gae`` are written here from reading verl's
``trainer/ppo/core_algos.py`` (``kl_penalty`` with "kl", "mse", "low_var_kl";
``compute_gae_advantage_return``, whose recursion skips positions with response mask 0,
and ``masked_whiten`` from ``utils/torch_functional.py``): the library's versions
(``workers.trainer.kl``, ``workers.trainer.gae``) must equal them to 1e-6.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from workers.trainer.gae import Rows, from_rows, gae, moments, to_rows, token_rewards, whiten
from workers.trainer.kl import kl_estimate

# ---- the references ------------------------------------------------------------------


def verl_kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str
                    ) -> torch.Tensor:
    if kind == "kl":
        return logprob - ref_logprob
    if kind == "mse":
        return 0.5 * (logprob - ref_logprob).square()
    assert kind == "low_var_kl"
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = (values * mask).sum() / mask.sum()
    variance = ((values - mean) ** 2 * mask).sum() / mask.sum()
    variance = variance * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def verl_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
             gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's recursion: every position computes a TD error, but one with mask 0 leaves
    the carried next value and advantage unchanged."""
    next_values = torch.zeros(rewards.shape[0], dtype=values.dtype)
    last = torch.zeros(rewards.shape[0], dtype=values.dtype)
    reversed_out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        candidate = delta + gamma * lam * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = candidate * mask[:, t] + (1 - mask[:, t]) * last
        reversed_out.append(last)
    advantages = torch.stack(reversed_out[::-1], dim=1)
    returns = advantages + values
    return verl_masked_whiten(advantages, mask), returns


# ---- KL ------------------------------------------------------------------------------

_VERL_NAMES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_equal_verls_kl_penalty(estimator: str) -> None:
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4096, generator=generator, dtype=torch.float64) * 8
    ref = -torch.rand(4096, generator=generator, dtype=torch.float64) * 8
    # Tokens the reference finds (nearly) impossible, and the reverse: k3's clamps bind.
    logprobs[:4] = torch.tensor([-0.01, -50.0, -0.0, -1e-3], dtype=torch.float64)
    ref[:4] = torch.tensor([-60.0, -0.01, -30.0, -25.0], dtype=torch.float64)
    ours = kl_estimate(logprobs, ref, estimator)  # type: ignore[arg-type]
    theirs = verl_kl_penalty(logprobs, ref, _VERL_NAMES[estimator])
    assert ours.shape == theirs.shape == (4096,)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    if estimator == "k3":
        assert float(ours.max()) == 10.0  # the clamp bound: a reference far below
    if estimator != "k1":
        assert float(ours.min()) >= 0.0


def test_kl_estimators_are_zero_at_the_reference_and_k3_gradient_flows() -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    for estimator in ("k1", "k2", "k3"):
        value = kl_estimate(logprobs, logprobs.detach(), estimator)  # type: ignore[arg-type]
        assert torch.equal(value, torch.zeros(3))
    kl = kl_estimate(logprobs, logprobs.detach() - 1.0, "k3").sum()
    kl.backward()
    assert logprobs.grad is not None and bool((logprobs.grad > 0).all())


def test_kl_of_an_empty_batch_is_empty() -> None:
    for estimator in ("k1", "k2", "k3"):
        assert kl_estimate(torch.zeros(0), torch.zeros(0), estimator).numel() == 0  # type: ignore[arg-type]


# ---- GAE -----------------------------------------------------------------------------


def _whitened(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return whiten(advantages, moments(advantages, mask))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 24), seed=st.integers(0, 2**31 - 1),
       gamma=st.sampled_from([1.0, 0.99, 0.9]), lam=st.sampled_from([1.0, 0.95, 0.5]),
       multi_turn=st.booleans())
def test_gae_equals_verls_on_random_rewards_values_and_masks(
        rows: int, width: int, seed: int, gamma: float, lam: float,
        multi_turn: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    values = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()  # right padding
    if multi_turn:  # observation tokens inside the rows (each row keeps a policy token)
        holes = torch.rand(rows, width, generator=generator) < 0.35
        holes[:, 0] = False
        mask = mask * (~holes).double()
    if mask.sum() < 2:
        return  # verl's whitening needs two tokens
    ours, returns = gae(rewards, values, mask.bool(), gamma=gamma, lam=lam)
    theirs, verl_returns = verl_gae(rewards, values, mask, gamma, lam)
    on = mask.bool()
    assert int(on.sum()) >= 2
    torch.testing.assert_close(_whitened(ours, mask)[on], theirs[on], atol=1e-6, rtol=0)
    torch.testing.assert_close(returns[on], verl_returns[on], atol=1e-6, rtol=0)
    assert bool((ours[~on] == 0).all()) and bool((returns[~on] == 0).all())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5))
def test_the_flat_layout_skipping_observations_equals_verls_multi_turn_gae(
        seed: int, rows: int) -> None:
    """The trainer's layout holds policy tokens only (observations are not predicted):
    GAE over those rows equals verl's over the whole trajectory with the loss mask."""
    generator = torch.Generator().manual_seed(seed)
    width = 16
    mask = torch.rand(rows, width, generator=generator) < 0.6
    mask[:, 0] = True  # every trajectory has a policy token
    values = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    outcome = torch.randn(rows, generator=generator, dtype=torch.float64)
    full_rewards = token_rewards(outcome, mask)
    verl_advantages, verl_returns = verl_gae(full_rewards, values, mask.double(), 0.95, 0.9)
    # The flat layout: each row's policy tokens, end to end.
    lengths = [int(n) for n in mask.sum(1)]
    flat_values = values[mask]
    layout = Rows.of(lengths)
    pad = layout.mask
    advantages, returns = gae(token_rewards(outcome, pad), to_rows(flat_values, layout), pad,
                              gamma=0.95, lam=0.9)
    flat_advantages = from_rows(advantages, layout)
    assert flat_advantages.shape == (sum(lengths),)
    if sum(lengths) >= 2:
        torch.testing.assert_close(whiten(flat_advantages, moments(flat_advantages)),
                                   verl_advantages[mask], atol=1e-6, rtol=0)
    torch.testing.assert_close(from_rows(returns, layout), verl_returns[mask], atol=1e-6,
                               rtol=0)


def test_outcome_reward_sits_on_the_last_policy_token() -> None:
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]).bool()
    rewards = token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 2, 0], [3, 0, 0, 0, 0], [0, 0, 0, 0, 0]]


def test_gae_with_gamma_and_lambda_one_is_the_outcome_minus_the_value() -> None:
    mask = torch.ones(1, 3, dtype=torch.bool)
    values = torch.tensor([[0.25, 0.5, 0.75]])
    advantages, returns = gae(token_rewards(torch.tensor([1.0]), mask), values, mask,
                              gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.75, 0.5, 0.25]]))
    torch.testing.assert_close(returns, torch.ones(1, 3))


def test_whitening_degenerate_cases() -> None:
    one = torch.tensor([3.0])
    assert whiten(one, moments(one)).tolist() == [0.0]  # one token: no spread
    none = torch.zeros(0)
    assert whiten(none, moments(none)).numel() == 0
    same = torch.full((5,), 2.0)
    assert whiten(same, moments(same)).tolist() == [0.0] * 5  # zero variance: all 0
    spread = torch.tensor([1.0, 2.0, 3.0])
    out = whiten(spread, moments(spread))
    assert math.isclose(float(out.mean()), 0.0, abs_tol=1e-7)
    assert math.isclose(float(out.std()), 1.0, rel_tol=1e-6)


def test_rows_round_trip_and_empty() -> None:
    flat = torch.arange(6.0)
    layout = Rows.of([3, 1, 2])
    rows = to_rows(flat, layout)
    assert rows.tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert layout.mask.tolist() == [[True, True, True], [True, False, False],
                                    [True, True, False]]
    assert torch.equal(from_rows(rows, layout), flat)
    empty = Rows.of([])
    rows = to_rows(torch.zeros(0), empty)
    assert rows.shape == (0, 0) and from_rows(rows, empty).numel() == 0
    # A sequence with no trained token: an empty row.
    assert to_rows(torch.arange(2.0), Rows.of([0, 2])).tolist() == [[0, 0], [0, 1]]
