"""PPO's step stages (``PpoStages``, a ``StepStages``): the roles around the policy's update.

Owns: calling each stage on every shard at once (the reference's logprobs, the critic's
values, the advantages, the policy's update, the critic's update; the step's data stays
on the shards), or, for a role on workers of its own (placement "own"), on those
workers, handing each shard its share of their outputs (by reference: the data goes
from worker to shard) and starting the own critic's update as soon as the shards have
their advantages, so that it runs while the policy's update does; a step whose groups
any of them lost computes nothing anywhere. Also the critic's warm-up
(critic.warmup_steps steps that train the critic only, before the policy's first
update: their prompts run again for the policy, as ``CRITIC_WARMUP``); the roles' columns
of the metrics row are ``async_rl.control.loss_stats``'. Knows nothing about Ray or
torch; the order of the stages is the training loop's.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from async_rl.config import Config
from async_rl.control.loss_stats import role_metrics
from async_rl.control.protocols import (
    OwnRoles,
    PendingCriticUpdate,
    RoleOutput,
    RoleStagesClient,
    TrainerClient,
    Workers,
)
from async_rl.control.run_health import RunHealth
from async_rl.control.step_stages import (
    CRITIC_WARMUP,
    GrpoStages,
    StepStages,
    StepUpdate,
    policy_update,
)
from buffers.common.concurrent_calls import each
from buffers.common.reports import CriticStepResult
from buffers.common.train_records import ShardBatch

log = logging.getLogger(__name__)


class PpoStages:
    """The stages on every shard (and every role's own worker), each call awaited on all
    before the next starts; a critic's update on workers of its own runs beside the
    policy's."""

    def __init__(self, shards: Sequence[RoleStagesClient], trainers: Sequence[TrainerClient],
                 health: RunHealth, *, warmup_steps: int, own: OwnRoles | None = None
                 ) -> None:
        """``shards``: the roles beside each trainer shard; ``trainers``: the shards whose
        policy updates; ``health``: judges the policy's update."""
        self.shards, self.trainers, self.health = list(shards), list(trainers), health
        self.own = own or OwnRoles()
        """The roles on workers of their own; their stages run there, and each trainer
        shard takes its share of their outputs."""
        self.warmup_left = warmup_steps
        """Critic-only steps still to make (a resumed run has made them)."""
        self.lost = False
        """Some shard or role worker lost the step's groups: no stage computes on it."""
        self._reference: list[RoleOutput] = []
        """The own reference's logprobs of the step, one per shard."""
        self._policy: list[RoleOutput] = []
        """Each shard's step-start policy's logprobs of the step (for the critic's KL
        in the reward)."""
        self._updates: list[PendingCriticUpdate] = []
        """The own critic's updates of the step, under way."""

    async def prepare(self, batches: Sequence[ShardBatch], step: int) -> None:
        """Every shard lays out its batch, then the reference's logprobs and the critic's
        values of it."""
        await self._lay_out(batches)
        await self._reference_logprobs(step)
        await self._critic_values(step)

    async def advantages(self, step: int) -> None:
        """GAE's advantages onto the shards; with the critic on workers of its own, its
        update then starts there (it needs nothing more) and runs beside the policy's."""
        critics = self.own.critics
        if not critics:
            await each([functools.partial(s.advantages, step) for s in self.shards])
            return
        if self.lost:
            return
        count = len(critics)
        reference = self._reference if self.own.reference_to_critic else []
        parts: list[list[RoleOutput]] = await each(
            [functools.partial(c.advantages, step, reference[rank::count],
                               self._policy[rank::count])
             for rank, c in enumerate(critics)])
        # Critic shard r holds trainer shards r, r + count, ...: back into shard order.
        per_shard = [parts[shard % count][shard // count] for shard in range(len(self.shards))]
        await each([functools.partial(s.take_advantages, step, out)
                    for s, out in zip(self.own.shards, per_shard, strict=True)])
        self._updates = [critic.start_update(step) for critic in critics]

    async def update(self, batches: Sequence[ShardBatch], step: int) -> StepUpdate:
        """The policy's update (not while the critic warms up), then the critic's."""
        warming_up = self.warming_up
        results = () if warming_up else await policy_update(self.trainers, batches)
        critic = tuple(await self._critic_update(step))
        untrained = (self._warmed_up(critic) if warming_up
                     else self.health.untrained_reason(step, results))
        return StepUpdate(results=results, critic=critic, untrained=untrained)

    def resumed(self) -> None:
        self.warmup_left = 0  # made before the checkpoint's first step

    def _warmed_up(self, critic: Sequence[CriticStepResult]) -> str:
        """Why a critic.warmup_steps step's prompts run again (for the policy, which did
        not train on them): ``CRITIC_WARMUP`` once the critic fitted them, or
        "samples_lost" when a shard could not fetch them (the warm-up step is taken
        anew)."""
        if any(c.samples_lost for c in critic):
            return "samples_lost"
        self.warmup_left -= 1
        metrics = role_metrics((), critic, measured_kl=False)
        log.info("critic warm-up step (%d left): value loss %.4g",
                 self.warmup_left, metrics.get("critic/value_loss", math.nan))
        return CRITIC_WARMUP

    async def _lay_out(self, batches: Sequence[ShardBatch]) -> None:
        """Every shard lays out its batch, every own worker the batches it serves;
        ``lost`` when any lost its groups (the shards are then told, if they did not lose
        them)."""
        critics = self.own.critics
        calls = [functools.partial(shard.prepare_step, batch)
                 for shard, batch in zip(self.shards, batches, strict=True)]
        if self.own.reference is not None:
            calls.append(functools.partial(self.own.reference.prepare_step, list(batches)))
        calls += [functools.partial(critic.prepare_step, list(batches[rank::len(critics)]))
                  for rank, critic in enumerate(critics)]
        lost = await each(calls)
        self.lost, self._reference, self._policy, self._updates = any(lost), [], [], []
        if self.lost and not any(lost[:len(self.shards)]):
            step = batches[0].step
            await each([functools.partial(s.step_lost, step) for s in self.own.shards])

    async def _reference_logprobs(self, step: int) -> None:
        reference = self.own.reference
        if reference is None:
            await each([functools.partial(s.reference_logprobs, step) for s in self.shards])
        elif not self.lost:
            # With the KL in the reward on the critic's own workers, the shards compute
            # their policy's logprobs meanwhile (those workers need both).
            policies = self.own.shards if self.own.reference_to_critic and self.own.critics else []
            calls: list[Callable[[], Awaitable[Any]]] = [
                functools.partial(reference.reference_logprobs, step),
                *(functools.partial(s.policy_logprobs, step) for s in policies)]
            outputs: list[Any] = await each(calls)
            self._reference, self._policy = outputs[0], outputs[1:]
            await each([functools.partial(s.take_reference, step, out)
                        for s, out in zip(self.own.shards, self._reference, strict=True)])

    async def _critic_values(self, step: int) -> None:
        if not self.own.critics:
            await each([functools.partial(s.critic_values, step) for s in self.shards])
        elif not self.lost:
            await each([functools.partial(c.critic_values, step) for c in self.own.critics])

    async def _critic_update(self, step: int) -> list[CriticStepResult]:
        critics = self.own.critics
        if not critics:
            results: list[CriticStepResult] = await each(
                [functools.partial(s.critic_update, step) for s in self.shards])
            return results
        if self.lost:
            return [CriticStepResult(rank=rank, step=step, samples_lost=True)
                    for rank in range(len(critics))]
        updates, self._updates = self._updates, []
        finished: list[CriticStepResult] = await each([u.result for u in updates])
        return finished

    @property
    def warming_up(self) -> bool:
        """This step trains the critic only (critic.warmup_steps)."""
        return self.warmup_left > 0


def step_stages(config: Config, workers: Workers, health: RunHealth) -> StepStages:
    """The run's step stages: PPO's when it has a reference or a critic (``workers``
    then bring their stages), GRPO's otherwise."""
    if not workers.stages:
        return GrpoStages(workers.trainers, health)
    return PpoStages(workers.stages, workers.trainers, health, own=workers.own,
                     warmup_steps=config.critic.warmup_steps if config.has_critic else 0)
