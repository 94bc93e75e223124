"""The PPO dataflow's stages around the policy's update, over every trainer shard.

Owns: calling each stage on every shard at once (``RoleStages``: the reference's
logprobs, the critic's values, the advantages, the critic's update; the step's data
stays on the shards), or, for a role on workers of its own (placement "own"), on those
workers, handing each shard its share of their outputs (by reference: the data goes
from worker to shard) and starting the own critic's update as soon as the shards have
their advantages, so that it runs while the policy's update does; a step whose groups
any of them lost computes nothing anywhere. Also the critic's warm-up
(critic.warmup_steps steps that train the critic only, before the policy's first
update); the roles' columns of the metrics row are ``async_rl.control.loss_stats``'.
Knows nothing about Ray or torch; the order of the stages is the orchestrator's loop.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from async_rl.control.protocols import (
    OwnRoles,
    PendingCriticUpdate,
    RoleOutput,
    RoleStagesClient,
)
from buffers.common.concurrent_calls import each
from buffers.common.records import ShardBatch
from buffers.common.reports import CriticStepResult


class RoleStages:
    """The stages on every shard (and every role's own worker), each call awaited on all
    before the next starts; a critic's update on workers of its own runs beside the
    policy's."""

    def __init__(self, shards: Sequence[RoleStagesClient], *, warmup_steps: int,
                 own: OwnRoles | None = None) -> None:
        self.shards = list(shards)
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

    async def prepare(self, batches: Sequence[ShardBatch]) -> bool:
        """Every shard lays out its batch, every own worker the batches it serves; True
        when any lost its groups (the shards are then told, if they did not lose them)."""
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
        return self.lost

    async def reference_logprobs(self, step: int) -> None:
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

    async def critic_values(self, step: int) -> None:
        if not self.own.critics:
            await each([functools.partial(s.critic_values, step) for s in self.shards])
        elif not self.lost:
            await each([functools.partial(c.critic_values, step) for c in self.own.critics])

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

    async def critic_update(self, step: int) -> list[CriticStepResult]:
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
