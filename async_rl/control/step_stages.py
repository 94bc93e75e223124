"""One training step's stages on the trainer shards, the same for GRPO and PPO.

Owns: the interface the training loop drives every step (``StepStages``: ``prepare``
then ``advantages`` then ``update``, each awaited on every shard before the next starts),
what an update hands back (``StepUpdate``: the shards' results and why the policy did
not move, if it did not), and GRPO's stages (``GrpoStages``: nothing before the update,
whose shards compute the advantages from the groups' rewards). PPO's stages, with the
reference, the critic and its warm-up, are ``async_rl.control.role_stages``'. Whether a
policy update counts (a shard lost its groups, a non-finite gradient) is
``RunHealth.untrained_reason``'s. Knows nothing about Ray or torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import msgspec

from async_rl.control.protocols import TrainerClient
from async_rl.control.run_health import RunHealth
from buffers.common.concurrent_calls import each
from buffers.common.reports import CriticStepResult
from buffers.common.train_records import ShardBatch, ShardStepResult

CRITIC_WARMUP = "critic_warmup"
"""Why a critic.warmup_steps step did not move the policy: its prompts run again."""


class StepUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """What a step's update did on every shard."""

    results: tuple[ShardStepResult, ...] = ()
    """The policy's update on each shard, in rank order (none while the critic warms up)."""
    critic: tuple[CriticStepResult, ...] = ()
    """The critic's update on each critic shard (none without a critic)."""
    untrained: str = ""
    """Why the policy did not move ("" when it did): its prompts then run again."""


class StepStages(Protocol):
    """A step's dataflow on the shards: laid out and scored, advantages, update."""

    @property
    def warming_up(self) -> bool:
        """The next step trains the critic only (critic.warmup_steps)."""
        ...

    async def prepare(self, batches: Sequence[ShardBatch], step: int) -> None:
        """Every shard lays out its batch and scores it for the advantages (PPO: the
        reference's logprobs, the critic's values)."""
        ...

    async def advantages(self, step: int) -> None:
        """The step's advantages onto the shards (PPO: GAE's)."""
        ...

    async def update(self, batches: Sequence[ShardBatch], step: int) -> StepUpdate:
        """The step's updates; the policy's moves it on unless ``untrained`` says why."""
        ...

    def resumed(self) -> None:
        """The run goes on from a checkpoint (any warm-up was made before it)."""
        ...


async def policy_update(shards: Sequence[TrainerClient], batches: Sequence[ShardBatch]
                        ) -> tuple[ShardStepResult, ...]:
    """The policy's update on every shard at once, each on its batch."""
    results: list[ShardStepResult] = await each([
        functools.partial(shard.train, batch)
        for shard, batch in zip(shards, batches, strict=True)])
    return tuple(results)


class GrpoStages:
    """GRPO's step: the shards compute the advantages from the groups' rewards within
    their update, so nothing runs before it."""

    warming_up = False

    def __init__(self, shards: Sequence[TrainerClient], health: RunHealth) -> None:
        self.shards, self.health = list(shards), health

    async def prepare(self, batches: Sequence[ShardBatch], step: int) -> None:
        """Nothing: each shard fetches its groups within its update."""

    async def advantages(self, step: int) -> None:
        """Nothing: group-normalised, on the batches already (``buffers.plan.batching``)."""

    async def update(self, batches: Sequence[ShardBatch], step: int) -> StepUpdate:
        results = await policy_update(self.shards, batches)
        return StepUpdate(results=results,
                          untrained=self.health.untrained_reason(step, results))

    def resumed(self) -> None:
        """Nothing to carry over."""
