"""The PPO roles beside the simulated trainer shards: the frozen reference (trainer.kl_coef
> 0, or a reference.path that measures the KL) and the critic (algorithm.advantage =
"gae"), both with placement "trainer", so their passes take the shard's devices.

Owns: ``SimRoles`` (each stage of the PPO dataflow on every shard, costed from the step's
micro-batches: the reference's logprobs and the critic's values a forward pass each
(``Costs.forward_pass``), the advantages nothing but the call (with trainer.kl_in_reward
after the policy's own forward pass, on its track), the critic's update a
forward and backward per micro-batch and an optimizer update of its own per policy
update, its full gradients all-reduced) and ``SimRoleStages`` (one shard's
``RoleStagesClient``). The spans are the real shard's (``workers.trainer.shard_roles``): the
reference's pass is the policy's ``forward`` (busy), the critic's passes are the
trainer's ``critic`` cause and the critic's own ``forward`` / ``backward`` on its track
(``critic-N``), which waits as ``policy`` while the policy trains. The critic has the
policy's shape (its value head in place of the LM head is not told apart). The order
of the stages is the real orchestrator's; so are the critic's warm-up steps. With
run.colocate = "time" the engines free the devices for the whole step, the roles'
passes included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from async_rl.config import Config
from async_rl.sim.costs import FORWARD_SHARE
from async_rl.sim.workers import SimTraining, policy_pass, sim_sequences
from buffers.common.reports import CriticStepResult
from buffers.common.train_records import ShardBatch
from workers.common.spans import SpanRecorder


def step_passes(config: Config) -> float:
    """A step's compute on a trainer shard's devices over the policy's forward and
    backward alone: the reference's forward, the critic's forward and its forward and
    backward added, and the policy's own forward for the KL in the reward (a
    calibration divides a run's step time by this)."""
    return (1 + FORWARD_SHARE * (config.has_reference + policy_pass(config))
            + (FORWARD_SHARE + 1) * config.has_critic)


class SimRoles:
    """The reference and the critic of every shard of ``training``."""

    def __init__(self, config: Config, training: SimTraining) -> None:
        self.training = training
        self.costs = training.costs
        self.reference = config.has_reference
        self.critic = config.has_critic
        self.policy_pass = policy_pass(config)
        shards = training.shards
        self.recorders = [SpanRecorder(worker=f"critic-{r}", role="critic", rank=r,
                                       device=f"sim:{r}", clock=training.cursor,
                                       enabled=config.run.record_spans and self.critic)
                          for r in range(shards)]
        if self.critic:
            training.waiting = self.recorders
        self.batches: list[ShardBatch | None] = [None] * shards
        """Each shard's batch of the step in progress (``prepare``)."""

    def _micro_batches(self, rank: int) -> list[list[int]]:
        batch = self.batches[rank]
        assert batch is not None, "a stage before prepare_step"
        return sim_sequences(batch)

    async def _stage(self, rank: int, step: int, work: Callable[[int], float],
                     tracks: Sequence[tuple[Sequence[SpanRecorder], str]]) -> float:
        """One stage: every shard's ``work(rank)`` seconds as ``tracks``' causes, once all
        shards have called; returns this shard's seconds."""
        async def run(_: list[int]) -> list[float]:
            return await self.training.beside_step(
                [work(r) for r in range(self.training.shards)], tracks)

        seconds: float = await self.training.together(rank, step, run)
        return seconds

    def _forward(self, rank: int) -> float:
        return sum(self.costs.forward_pass(mb) for mb in self._micro_batches(rank))

    def _critic_update(self, rank: int) -> float:
        batch = self.batches[rank]
        assert batch is not None
        updates = len(batch.updates)
        return (sum(self.costs.micro_batch(mb) for mb in self._micro_batches(rank))
                + updates * self.costs.update(self.training.shards,
                                              self.costs.model.parameters))

    async def prepare(self, rank: int, batch: ShardBatch) -> bool:
        """The step's layout; time-shared engines free the devices for the passes."""
        self.batches[rank] = batch

        async def run(_: list[int]) -> list[float]:
            await self.training.release_devices()
            return await self.training.beside_step([0.0] * self.training.shards, ())

        await self.training.together(rank, batch.step, run)
        return False

    async def reference_logprobs(self, rank: int, step: int) -> None:
        if self.reference:
            await self._stage(rank, step, self._forward,
                              ((self.training.recorders, "forward"),))
        else:
            await self._stage(rank, step, lambda r: 0.0, ())

    def _critic_tracks(self, cause: str) -> tuple[tuple[Sequence[SpanRecorder], str], ...]:
        return ((self.training.recorders, "critic"), (self.recorders, cause))

    async def critic_values(self, rank: int, step: int) -> None:
        if self.critic:
            await self._stage(rank, step, self._forward, self._critic_tracks("forward"))
        else:
            await self._stage(rank, step, lambda r: 0.0, ())

    async def advantages(self, rank: int, step: int) -> None:
        """GAE over the step's tokens: arithmetic the passes dwarf, so the call alone,
        after the policy's own forward when the KL is in the reward."""
        if self.policy_pass:
            await self._stage(rank, step, self._forward, ((self.training.recorders, "forward"),))
        await self._stage(rank, step, lambda r: 0.0,
                          self._critic_tracks("forward") if self.critic else ())

    async def critic_update(self, rank: int, step: int) -> CriticStepResult:
        if not self.critic:  # still a call to every shard, as in a real run
            await self._stage(rank, step, lambda r: 0.0, ())
            return CriticStepResult(rank=rank, step=step)
        seconds = await self._stage(rank, step, self._critic_update,
                                    self._critic_tracks("backward"))
        self.training.return_devices()  # the step's last pass (time-shared engines)
        completion = sum(self._completion_tokens(rank))
        self.batches[rank] = None
        return CriticStepResult(rank=rank, step=step, tokens=completion, seconds=seconds)

    def _completion_tokens(self, rank: int) -> list[int]:
        batch = self.batches[rank]
        assert batch is not None
        return [n for mb in sim_sequences(batch, completion=True) for n in mb]


class SimRoleStages:
    """One shard's ``RoleStagesClient`` over ``SimRoles``."""

    def __init__(self, rank: int, roles: SimRoles) -> None:
        self.rank, self.roles = rank, roles

    async def prepare_step(self, batch: ShardBatch) -> bool:
        return await self.roles.prepare(self.rank, batch)

    async def reference_logprobs(self, step: int) -> None:
        await self.roles.reference_logprobs(self.rank, step)

    async def critic_values(self, step: int) -> None:
        await self.roles.critic_values(self.rank, step)

    async def advantages(self, step: int) -> None:
        await self.roles.advantages(self.rank, step)

    async def critic_update(self, step: int) -> CriticStepResult:
        return await self.roles.critic_update(self.rank, step)
