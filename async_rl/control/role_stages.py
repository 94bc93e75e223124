"""The PPO dataflow's stages around the policy's update, over every trainer shard.

Owns: calling each stage on every shard at once (``RoleStages``: the reference's
logprobs, the critic's values, the advantages, the critic's update; the step's data
stays on the shards) and the critic's warm-up (critic.warmup_steps steps that train the
critic only, before the policy's first update); the roles' columns of the metrics row
are ``async_rl.control.loss_stats``'. Knows nothing about Ray or torch; the order of the
stages is the orchestrator's loop.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from async_rl.control.protocols import RoleStagesClient
from buffers.concurrent_calls import each
from buffers.records import ShardBatch
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
