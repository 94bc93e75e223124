"""The PPO dataflow's stages around the policy's update, over every trainer shard.

Owns: calling each stage on every shard at once (``RoleStages``: the reference's
logprobs, the critic's values, the advantages, the critic's update; the step's data
stays on the shards), the critic's warm-up (critic.warmup_steps steps that train the
critic only, before the policy's first update) and the per-step metrics of the roles
(``role_metrics``: ``kl/mean``, ``kl/max`` from the policy's update, ``critic/*`` from
the critic's). Knows nothing about Ray or torch; the order of the stages is the
orchestrator's loop.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from async_rl.control.protocols import RoleStagesClient
from buffers.concurrent_calls import each
from buffers.records import ShardBatch, ShardStepResult
from buffers.reports import CriticStepResult


class RoleStages:
    """The stages on every shard, each call awaited on all before the next starts."""

    def __init__(self, shards: Sequence[RoleStagesClient], *, warmup_steps: int) -> None:
        self.shards = list(shards)
        self.warmup_left = warmup_steps
        """Critic-only steps still to make (a resumed run has made them)."""

    async def prepare(self, batches: Sequence[ShardBatch]) -> bool:
        """Every shard lays out its batch; True when some shard lost its groups."""
        lost = await each([functools.partial(shard.prepare_step, batch)
                           for shard, batch in zip(self.shards, batches, strict=True)])
        return any(lost)

    async def reference_logprobs(self, step: int) -> None:
        await each([functools.partial(s.reference_logprobs, step) for s in self.shards])

    async def critic_values(self, step: int) -> None:
        await each([functools.partial(s.critic_values, step) for s in self.shards])

    async def advantages(self, step: int) -> None:
        await each([functools.partial(s.advantages, step) for s in self.shards])

    async def critic_update(self, step: int) -> list[CriticStepResult]:
        results: list[CriticStepResult] = await each(
            [functools.partial(s.critic_update, step) for s in self.shards])
        return results

    @property
    def warming_up(self) -> bool:
        """This step trains the critic only (critic.warmup_steps)."""
        return self.warmup_left > 0


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
