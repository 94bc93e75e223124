"""A step's loss statistics as the metrics log shows them: the shards' ``LossStats``
added up, and their per-token means.

Owns: ``merge_stats`` and ``summarise`` (the policy's loss), and the PPO roles' columns
(``role_metrics``: ``kl/mean``, ``kl/max`` from the policy's update, ``critic/*`` from
the critic's). The shards count their statistics (``workers.trainer.loss``) and report
them in ``buffers.common.records``' records; reading them is the control plane's, beside the
metrics row (``async_rl.control.step_metrics``). Knows nothing about the loss's
formula or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from buffers.common.reports import CriticStepResult
from buffers.common.train_records import LossStats, ShardStepResult


def merge_stats(parts: Sequence[LossStats]) -> LossStats:
    """Adds micro-batch (or shard) statistics into one."""
    return LossStats(
        tokens=sum(p.tokens for p in parts),
        loss_sum=sum(p.loss_sum for p in parts),
        clipped=sum(p.clipped for p in parts),
        dual_clipped=sum(p.dual_clipped for p in parts),
        out_of_band=sum(p.out_of_band for p in parts),
        is_weight_sum=sum(p.is_weight_sum for p in parts),
        is_weight_sq_sum=sum(p.is_weight_sq_sum for p in parts),
        is_weight_max=max((p.is_weight_max for p in parts), default=0.0),
        kl_sum=sum(p.kl_sum for p in parts),
        entropy_sum=sum(p.entropy_sum for p in parts),
        router_aux_sum=sum(p.router_aux_sum for p in parts),
    )


def summarise(stats: LossStats) -> dict[str, float]:
    """Per-token means of a step's statistics, for the metrics log (``router_aux`` only
    where the router loss was on: trainer.router_aux_coef > 0)."""
    n = max(stats.tokens, 1)
    ess = (
        stats.is_weight_sum**2 / (n * stats.is_weight_sq_sum) if stats.is_weight_sq_sum else 1.0
    )
    router = {"router_aux": stats.router_aux_sum / n} if stats.router_aux_sum else {}
    return {
        "loss": stats.loss_sum / n,
        "clip_fraction": stats.clipped / n,
        "dual_clip_fraction": stats.dual_clipped / n,
        "is_out_of_band_fraction": stats.out_of_band / n,
        "is_weight_mean": stats.is_weight_sum / n,
        "is_weight_max": stats.is_weight_max,
        "ess": ess,
        "kl_behaviour": stats.kl_sum / n,
        "entropy": stats.entropy_sum / n,
        **router,
    }


def role_metrics(results: Sequence[ShardStepResult], critic: Sequence[CriticStepResult],
                 *, measured_kl: bool) -> dict[str, Any]:
    """The roles' columns of a step's metrics row: the KL to the reference over the
    policy's trained tokens (``kl/mean``, ``kl/max``; ``measured_kl``: the run has a
    reference) and the critic's update (``critic/*``; with a critic)."""
    row: dict[str, Any] = {}
    tokens = sum(r.loss.tokens for r in results)
    if measured_kl and tokens:
        row["kl/mean"] = sum(r.kl_sum for r in results) / tokens
        row["kl/max"] = max(r.kl_max for r in results)
    counted = sum(c.tokens for c in critic)
    if counted:
        row["critic/value_loss"] = sum(c.value_loss_sum for c in critic) / counted
        row["critic/clip_fraction"] = sum(c.clipped for c in critic) / counted
        row["critic/value_mean"] = sum(c.value_sum for c in critic) / counted
        row["critic/return_mean"] = sum(c.return_sum for c in critic) / counted
        norms = [c.grad_norm for c in critic]
        row["critic/grad_norm"] = max(norms, key=lambda n: n if math.isfinite(n) else math.inf)
        row["critic/update_s"] = max(c.seconds for c in critic)
    return row
