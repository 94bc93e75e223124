"""A step's loss statistics as the metrics log shows them: the shards' ``LossStats``
added up, and their per-token means.

Owns: ``merge_stats`` and ``summarise``. The shards count their statistics
(``workers.trainer.loss``) and report them in ``buffers.records.LossStats``; reading them
is the control plane's, beside the metrics row (``async_rl.control.step_metrics``).
Knows nothing about the loss's formula or torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from buffers.records import LossStats


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
        "dual_clip_fraction": stats.dual_clipped / n,
        "is_out_of_band_fraction": stats.out_of_band / n,
        "is_weight_mean": stats.is_weight_sum / n,
        "is_weight_max": stats.is_weight_max,
        "ess": ess,
        "kl_behaviour": stats.kl_sum / n,
        "entropy": stats.entropy_sum / n,
    }
