"""The Ray actors: the plain rollout worker and trainer shard, plus moving tokens by reference.

Owns: the only two things the actors add to the plain classes — a rollout actor leaves
each group's ``GroupTokens`` in Ray's object store and returns the group's metadata with
a reference (``generate_group_ref``); a trainer actor resolves the references of its
batch straight from the object store before training (``train_step_by_ref``). So a
token goes from the engine that sampled it to the shard that trains it without passing
through the driver. Knows nothing about the run's logic; ``async_rl.shell.launch`` creates
these actors with ``ray.remote(...)``.
"""

from __future__ import annotations

import msgspec
import ray

from buffers.records import Group, Prompt, ShardBatch, ShardStepResult
from workers.rollout.worker import RolloutWorker
from workers.trainer.shard import TrainerShard


class RolloutActor(RolloutWorker):
    """A rollout worker whose groups leave their tokens in the object store."""

    async def generate_group_ref(self, prompt: Prompt) -> Group:
        """``generate_group``, with ``tokens`` a reference owned by this actor.

        The reference's object lives as long as someone holds the reference and this
        actor lives: if the actor dies first, a shard fetching it gets
        ``ObjectLostError`` (``train_step_by_ref`` reports that as lost samples).
        """
        group = await self.generate_group(prompt)
        return msgspec.structs.replace(group, tokens=ray.put(group.tokens))


class TrainerActor(TrainerShard):
    """A trainer shard that fetches its batch's groups from the object store itself."""

    def train_step_by_ref(self, batch: ShardBatch) -> ShardStepResult:
        """``train_step`` on ``batch`` with its group references resolved here.

        Fetching fails when a group's rollout worker died after generating it; this
        shard then tells the others in the step's first all-reduce and no shard trains.
        """
        try:
            tokens = ray.get(list(batch.groups))
        except ray.exceptions.ObjectLostError:
            return self.train_step(batch, None)
        return self.train_step(batch, tokens)
