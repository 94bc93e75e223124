"""The Ray actors: the plain rollout worker, trainer shard and roles of their own, plus
moving tokens by reference.

Owns: the only two things the actors add to the plain classes — a rollout actor leaves
each group's ``GroupTokens`` in Ray's object store and returns the group's metadata with
a reference (``generate_group_ref``); a trainer actor resolves the references of its
batch straight from the object store before training (``train_step_by_ref``, or
``prepare_step_by_ref`` when the PPO dataflow's stages run first: their entry points
are here too). So a
token goes from the engine that sampled it to the shard that trains it without passing
through the driver. The reference and the critic on workers of their own
(``ReferenceActor``, ``CriticActor``) fetch their groups the same way and leave each
shard's share of their outputs in the object store, which the driver hands to that
shard by reference (``take_reference``, ``take_advantages``); a trainer shard leaves its
step-start policy's logprobs there for the critic's workers the same way
(``policy_logprobs_ref``, trainer.kl_in_reward). Knows nothing about the run's logic;
``async_rl.shell.launch`` creates these actors with ``ray.remote(...)``.
"""

from __future__ import annotations

import msgspec
import ray

from buffers.common.partials import PartialGroup
from buffers.common.records import Group, GroupTokens, Prompt
from buffers.common.reports import CriticStepResult
from buffers.common.train_records import ShardBatch, ShardStepResult
from workers.rollout.worker import RolloutWorker
from workers.trainer.ppo_stages import Tensors
from workers.trainer.role_workers import CriticWorker, ReferenceWorker
from workers.trainer.shard import TrainerShard


class RolloutActor(RolloutWorker):
    """A rollout worker whose groups leave their tokens in the object store."""

    async def generate_group_ref(self, prompt: Prompt) -> Group | PartialGroup:
        """``generate_group``, with ``tokens`` a reference owned by this actor.

        The reference's object lives as long as someone holds the reference and this
        actor lives: if the actor dies first, a shard fetching it gets
        ``ObjectLostError`` (``train_step_by_ref`` reports that as lost samples). A
        partial group (handed back) comes whole: the driver keeps it.
        """
        return _by_ref(await self.generate_group(prompt))

    async def continue_group_ref(self, partial: PartialGroup) -> Group | PartialGroup:
        """``continue_group``, its group's tokens left in the object store as above."""
        return _by_ref(await self.continue_group(partial))


def _by_ref(result: Group | PartialGroup) -> Group | PartialGroup:
    if isinstance(result, PartialGroup):
        return result
    return msgspec.structs.replace(result, tokens=ray.put(result.tokens))


class TrainerActor(TrainerShard):
    """A trainer shard that fetches its batch's groups from the object store itself."""

    def train_step_by_ref(self, batch: ShardBatch) -> ShardStepResult:
        """``train_step`` on ``batch`` with its group references resolved here (or by
        ``prepare_step_by_ref``, in the PPO dataflow)."""
        if self.roles is not None and self.roles.holds(batch.step):
            return self.train_step(batch, None)  # prepare_step_by_ref fetched them
        return self.train_step(batch, _fetch(batch))

    # ---- the PPO dataflow's stages (workers.trainer.shard_roles), in the orchestrator's order --

    def prepare_step_by_ref(self, batch: ShardBatch) -> bool:
        """Fetches ``batch``'s groups and lays the step out for the stages below and
        the policy's update; True when some shard lost its groups."""
        return self.stages().prepare(batch, _fetch(batch))

    def reference_logprobs(self, step: int) -> None:
        self.stages().reference_logprobs(step)

    def critic_values(self, step: int) -> None:
        self.stages().critic_values(step)

    def advantages(self, step: int) -> None:
        self.stages().advantages(step)

    def critic_update(self, step: int) -> CriticStepResult:
        return self.stages().critic_update(step, self.rank)

    # ---- what roles on workers of their own send (placement "own") ----------------------

    def take_reference(self, step: int, logprobs: Tensors) -> None:
        """``logprobs``: passed by reference, resolved by Ray from the reference
        worker's store before this runs."""
        self.stages().take_reference(step, logprobs)

    def take_advantages(self, step: int, advantages: Tensors) -> None:
        self.stages().take_advantages(step, advantages)

    def policy_logprobs_ref(self, step: int) -> ray.ObjectRef[Tensors]:
        """The step-start policy's logprobs of this shard's micro-batches, left in the
        object store (owned by this actor) for the critic's own workers."""
        return ray.put([None if t is None else t.cpu()
                        for t in self.stages().policy_logprobs(step)])

    def step_lost(self, step: int) -> None:
        self.stages().step_lost(step)


class ReferenceActor(ReferenceWorker):
    """The reference on a worker of its own: fetches its groups, leaves its outputs in
    the object store for the shards."""

    def prepare_step_by_ref(self, batches: list[ShardBatch]) -> bool:
        return self.prepare(batches, _fetch_all(batches))

    def reference_logprobs_refs(self, step: int) -> list[ray.ObjectRef[Tensors]]:
        """One reference per batch prepared: that shard's logprobs, owned by this actor."""
        return [ray.put(part) for part in self.logprobs(step)]


class CriticActor(CriticWorker):
    """A critic shard on a worker of its own: fetches its groups, leaves the advantages
    in the object store for the shards."""

    def prepare_step_by_ref(self, batches: list[ShardBatch]) -> bool:
        return self.prepare(batches, _fetch_all(batches))

    def advantages_refs(self, step: int, *logprobs: Tensors) -> list[ray.ObjectRef[Tensors]]:
        """One reference per batch prepared: that shard's advantages. ``logprobs``: the
        reference's logprobs of each batch, then the step-start policy's (for the KL in
        the reward; none without it), passed by reference (resolved by Ray)."""
        half = len(logprobs) // 2
        return [ray.put(part) for part in self.advantages(step, logprobs[:half],
                                                          logprobs[half:])]


def _fetch(batch: ShardBatch) -> list[GroupTokens] | None:
    """The batch's groups from the object store; None when one was lost (its rollout
    worker died after generating it): the shard then tells the others in the step's
    first all-reduce and no shard trains."""
    try:
        tokens: list[GroupTokens] = ray.get(list(batch.groups))
    except ray.exceptions.ObjectLostError:
        return None
    return tokens


def _fetch_all(batches: list[ShardBatch]) -> list[list[GroupTokens]] | None:
    """``_fetch`` of every batch; None when any lost a group."""
    fetched: list[list[GroupTokens]] = []
    for batch in batches:
        tokens = _fetch(batch)
        if tokens is None:
            return None
        fetched.append(tokens)
    return fetched
