"""``workers.trainer.loss.token_loss`` against reference implementations written from their
definitions: AReaL's decoupled PPO objective, verl's vanilla PPO loss with dual-clip, and
this project's previous loss (which the single-update default must reproduce exactly).

The references work the way those systems do, on right-padded ``(batch, time)`` tensors
with a response mask; ``token_loss`` sees the same tokens flattened, sequence after
sequence. Random batches of mixed lengths, about 5% of tokens far off-policy, several
seeds, float64; loss and gradient (with respect to the current logprobs) must agree to
1e-6.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from async_rl.control.loss_stats import summarise
from workers.trainer.config import TrainerConfig
from workers.trainer.loss import Normaliser, read_stats, token_loss

SEEDS = range(5)
BATCH, WIDTH = 7, 13
CAP = 2.0


# -- the references ---------------------------------------------------------------------


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum()


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int) -> torch.Tensor:
    """verl's ``agg_loss``; seq-mean-token-sum-norm as Dr. GRPO (and TRL's "dr_grpo")
    define it: each sequence's token sum / max_len, averaged over the sequences. (verl
    divides the summed sequence sums by max_len only and leaves the per-sequence average
    to its micro-batch scaling: the same up to a constant factor.)"""
    if mode == "token_mean":
        return masked_mean(loss_mat, mask)
    seq_sums = (loss_mat * mask).sum(-1)
    if mode == "seq_mean_token_mean":
        return (seq_sums / mask.sum(-1)).mean()
    return (seq_sums / max_len).mean()


def areal_decoupled_loss(logprobs: torch.Tensor, proximal: torch.Tensor, old: torch.Tensor,
                         advantages: torch.Tensor, mask: torch.Tensor, *, eps_low: float,
                         eps_high: float, c_clip: float, cap: float, mode: str,
                         agg: str = "token_mean", max_len: int = WIDTH) -> torch.Tensor:
    """AReaL's decoupled PPO actor loss: PPO-clip (with dual-clip) on pi / pi_prox, times
    the behaviour importance weight pi_prox / pi_old, which is masked above the cap
    (AReaL's behav_imp_weight_cap) or, in truncate mode, cut to it (TIS)."""
    ratio = torch.where(mask, torch.exp(logprobs - proximal), 0.0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * clipped_ratio
    pg_loss = torch.max(pg_loss1, pg_loss2)
    pg_loss3 = torch.sign(advantages) * c_clip * advantages
    pg_loss = torch.min(pg_loss, pg_loss3)
    behav_imp_weight = (proximal - old).exp()
    if mode == "mask":
        behav_mask = (behav_imp_weight <= cap).logical_and(mask)
        behav_imp_weight = torch.where(behav_mask, behav_imp_weight, 0.0)
    else:
        behav_imp_weight = torch.clamp(behav_imp_weight, max=cap)
    pg_loss = pg_loss * behav_imp_weight
    return agg_loss(torch.where(mask, pg_loss, 0.0), mask, agg, max_len)


def verl_vanilla_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                      advantages: torch.Tensor, response_mask: torch.Tensor, *,
                      cliprange_low: float, cliprange_high: float, clip_ratio_c: float,
                      agg: str = "token_mean", max_len: int = WIDTH
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl's ``compute_policy_loss_vanilla``: (loss, pg_clipfrac, pg_clipfrac_lower)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).double(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).double(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return agg_loss(pg_losses, response_mask, agg, max_len), pg_clipfrac, pg_clipfrac_lower


def previous_token_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                        advantages: torch.Tensor, *, global_tokens: int, clip_low: float,
                        clip_high: float, tis_cap: float) -> torch.Tensor:
    """The loss before decoupled PPO with real updates (its tis_cap > 0 branch): the
    proximal ratio exp(lp - sg(lp)) = 1 times the truncated IS weight."""
    ratio = torch.exp(logprobs - behaviour_logprobs)
    proximal_ratio = torch.exp(logprobs - logprobs.detach())
    weight = torch.clamp(ratio.detach(), max=tis_cap)
    per_token = -(weight * proximal_ratio * advantages)
    return per_token.sum() / max(global_tokens, 1)


# -- random batches ---------------------------------------------------------------------


def batch(seed: int, *, far: float = 15.0) -> dict[str, torch.Tensor]:
    """A padded batch: lengths 1..WIDTH, per-sequence advantages, proximal logprobs, the
    current policy a little away from them and the behaviour policy a little away too,
    with ~5% of tokens far off-policy (log-ratios of 5 to ``far`` nats, either sign)."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand((BATCH, WIDTH), generator=gen,
                                               dtype=torch.float64)

    lengths = torch.randint(1, WIDTH + 1, (BATCH,), generator=gen)
    mask = torch.arange(WIDTH)[None, :] < lengths[:, None]
    advantages = (torch.randn(BATCH, generator=gen, dtype=torch.float64)[:, None]
                  .expand(BATCH, WIDTH).clone())
    proximal = -uniform(0.05, 4.0)
    current = proximal + uniform(-0.4, 0.4)
    behaviour = proximal + uniform(-0.4, 0.4)
    sign = torch.where(torch.rand((BATCH, WIDTH), generator=gen) < 0.5, -1.0, 1.0)
    for target in (current, behaviour):
        off = torch.rand((BATCH, WIDTH), generator=gen) < 0.05
        target += torch.where(off, sign * uniform(5.0, far), 0.0)
    return {"mask": mask, "advantages": advantages, "proximal": proximal,
            "current": current, "behaviour": behaviour}


def flat(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked tokens, sequence after sequence (row-major)."""
    return tensor[mask]


def ours(data: dict[str, torch.Tensor], *, proximal: bool, agg: str = "token_mean",
         **config: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """token_loss over the batch's tokens: (loss, d loss / d current per padded slot, the
    summary statistics)."""
    mask = data["mask"]
    current = data["current"].clone().requires_grad_(True)
    lengths = mask.sum(-1).tolist()
    norm = Normaliser(agg=agg, tokens=int(mask.sum()), sequences=BATCH,  # type: ignore[arg-type]
                      max_response_tokens=WIDTH)
    loss, stats = token_loss(
        flat(current, mask), flat(data["behaviour"], mask), flat(data["advantages"], mask),
        lengths=lengths, norm=norm, config=TrainerConfig(loss_agg=agg, **config),
        proximal_logprobs=flat(data["proximal"], mask) if proximal else None,
    )
    loss.backward()
    assert current.grad is not None
    return loss.detach(), current.grad, summarise(read_stats([stats]))


def reference_grad(loss_fn: Any, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    current = data["current"].clone().requires_grad_(True)
    loss = loss_fn(current)
    loss.backward()
    assert current.grad is not None
    return loss.detach(), current.grad * data["mask"]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# -- (a) AReaL's decoupled objective ------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_decoupled_loss_matches_areal(seed: int, mode: str, agg: str) -> None:
    data = batch(seed)
    want, want_grad = reference_grad(
        lambda current: areal_decoupled_loss(
            current, data["proximal"], data["behaviour"], data["advantages"], data["mask"],
            eps_low=0.2, eps_high=0.28, c_clip=3.0, cap=CAP, mode=mode, agg=agg),
        data)
    got, got_grad, _ = ours(data, proximal=True, agg=agg, tis_cap=CAP, tis_mode=mode)
    close(got, want)
    close(got_grad, want_grad)
    assert got_grad.abs().sum() > 0


# -- (b) verl's vanilla PPO with dual-clip -------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_plain_loss_matches_verl_vanilla_with_dual_clip(seed: int, agg: str) -> None:
    # far = 100: verl clamps its log-ratios at +-20 too, so even these must agree.
    data = batch(seed, far=100.0)
    outputs: dict[str, torch.Tensor] = {}

    def reference(current: torch.Tensor) -> torch.Tensor:
        loss, outputs["clipfrac"], outputs["lower"] = verl_vanilla_loss(
            data["behaviour"], current, data["advantages"], data["mask"],
            cliprange_low=0.2, cliprange_high=0.28, clip_ratio_c=3.0, agg=agg)
        return loss

    want, want_grad = reference_grad(reference, data)
    got, got_grad, summary = ours(data, proximal=False, agg=agg, tis_cap=0.0)
    close(got, want)
    close(got_grad, want_grad)
    assert summary["clip_fraction"] == pytest.approx(float(outputs["clipfrac"]), abs=1e-12)
    assert summary["dual_clip_fraction"] == pytest.approx(float(outputs["lower"]), abs=1e-12)
    assert summary["clip_fraction"] > 0


# -- the previous loss: one update per step reproduces it exactly --------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_single_update_default_equals_the_previous_loss_exactly(
    seed: int, dtype: torch.dtype
) -> None:
    data = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch(seed).items()}
    mask = data["mask"]
    current = data["current"].clone().requires_grad_(True)
    behaviour, advantages = flat(data["behaviour"], mask), flat(data["advantages"], mask)
    old = previous_token_loss(flat(current, mask), behaviour, advantages,
                              global_tokens=int(mask.sum()), clip_low=0.2, clip_high=0.28,
                              tis_cap=CAP)
    old.backward()
    old_grad = current.grad
    current.grad = None
    config = TrainerConfig()  # the defaults: decoupled, tis_cap 2, truncate, token_mean
    assert (config.mini_batches, config.epochs, config.tis_cap) == (1, 1, CAP)
    new, _ = token_loss(flat(current, mask), behaviour, advantages,
                        lengths=mask.sum(-1).tolist(),
                        norm=Normaliser(agg="token_mean", tokens=int(mask.sum()),
                                        sequences=BATCH),
                        config=config)
    new.backward()
    assert torch.equal(new.detach(), old.detach())
    assert current.grad is not None and old_grad is not None
    assert torch.equal(current.grad, old_grad)


# -- far off-policy tokens stay finite ----------------------------------------------------


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("advantage", [1.5, -1.5])
@pytest.mark.parametrize(
    "config",
    [{"tis_cap": 0.0}, {"tis_cap": CAP}, {"tis_cap": CAP, "tis_mode": "mask"},
     {"tis_cap": CAP, "loss_agg": "seq_mean_token_mean"}],
)
@pytest.mark.parametrize("proximal_shift", [None, 0.0, 100.0, -100.0])
def test_no_nan_or_inf_at_log_ratio_100(
    log_ratio: float, advantage: float, config: dict[str, Any], proximal_shift: float | None
) -> None:
    behaviour = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    current = (behaviour + torch.tensor([log_ratio, 0.1], dtype=torch.float64)
               ).requires_grad_(True)
    proximal = None if proximal_shift is None else behaviour + proximal_shift
    loss, stats = token_loss(
        current, behaviour, torch.full((2,), advantage, dtype=torch.float64), lengths=[2],
        norm=Normaliser(agg=config.get("loss_agg", "token_mean"), tokens=2, sequences=1),
        config=TrainerConfig(**config), proximal_logprobs=proximal)
    loss.backward()
    assert current.grad is not None
    assert torch.isfinite(loss).item()
    assert torch.isfinite(current.grad).all()
    assert all(torch.isfinite(torch.tensor(v)) for v in summarise(read_stats([stats])).values())
