"""GRPO math: group-normalised advantages and the off-policy clipped token loss.

Owns: the GRPO advantage and token-loss formulas and the per-step loss statistics.
Knows nothing about batching, devices or distribution: callers pass flat token tensors
and the global token count, and sum the returned loss across micro-batches and shards.

Two forms, chosen by ``tis_cap``:
- bypass (tis_cap = 0): PPO-clip with the vLLM behaviour logprobs as the old policy,
  ratio = pi_theta / pi_behaviour, clipped to [1 - clip_low, 1 + clip_high].
- decoupled (tis_cap > 0): the proximal policy is the trainer's own policy at step start
  (detached), so the clipped ratio is 1 on the single update this system makes per batch,
  and the off-policy correction is the truncated importance weight
  min(pi_theta / pi_behaviour, C), detached (AReaL's decoupled PPO with TIS).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from async_rl.records import LossStats


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) within one group; an all-equal group gets zeros."""
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / n
    std = math.sqrt(var)
    if std < eps:
        return [0.0] * n
    return [(r - mean) / (std + eps) for r in rewards]


def token_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    global_tokens: int,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
) -> tuple[torch.Tensor, LossStats]:
    """Loss over completion tokens, normalised by ``global_tokens`` (all shards' tokens).

    All three tensors are 1-D over the same completion tokens. The returned loss is a
    sum / global_tokens, so adding the losses of every micro-batch on every shard gives
    the mean token loss of the whole step regardless of how tokens were split.
    """
    log_ratio = logprobs - behaviour_logprobs
    ratio = torch.exp(log_ratio)
    if tis_cap > 0:
        proximal_ratio = torch.exp(logprobs - logprobs.detach())
        weight = torch.clamp(ratio.detach(), max=tis_cap)
        per_token = -(weight * proximal_ratio * advantages)
    else:
        weight = ratio.detach()
        clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    loss = per_token.sum() / max(global_tokens, 1)
    with torch.no_grad():
        outside = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
        # k3 estimator of KL(behaviour || current) on behaviour samples: r - 1 - log r
        # with r = pi_theta / pi_behaviour (unbiased, never negative).
        log_r = log_ratio.detach()
        k3 = torch.exp(log_r) - 1.0 - log_r
        stats = LossStats(
            tokens=int(logprobs.numel()),
            loss_sum=float(per_token.sum()),
            clipped=int(outside.sum()),
            is_weight_sum=float(weight.sum()),
            is_weight_sq_sum=float((weight * weight).sum()),
            is_weight_max=float(weight.max()) if weight.numel() else 0.0,
            kl_sum=float(k3.sum()),
        )
    return loss, stats


def merge_stats(parts: Sequence[LossStats]) -> LossStats:
    """Adds micro-batch (or shard) statistics into one."""
    return LossStats(
        tokens=sum(p.tokens for p in parts),
        loss_sum=sum(p.loss_sum for p in parts),
        clipped=sum(p.clipped for p in parts),
        is_weight_sum=sum(p.is_weight_sum for p in parts),
        is_weight_sq_sum=sum(p.is_weight_sq_sum for p in parts),
        is_weight_max=max((p.is_weight_max for p in parts), default=0.0),
        kl_sum=sum(p.kl_sum for p in parts),
    )


def summarise(stats: LossStats) -> dict[str, float]:
    """Per-token means of a step's statistics, for the metrics log."""
    n = max(stats.tokens, 1)
    ess = (
        stats.is_weight_sum**2 / (n * stats.is_weight_sq_sum) if stats.is_weight_sq_sum else 1.0
    )
    return {
        "loss": stats.loss_sum / n,
        "clip_fraction": stats.clipped / n,
        "is_weight_mean": stats.is_weight_sum / n,
        "is_weight_max": stats.is_weight_max,
        "ess": ess,
        "kl_behaviour": stats.kl_sum / n,
    }
