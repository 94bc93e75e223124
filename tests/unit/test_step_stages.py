"""The step stages the training loop drives, on fakes of the shard protocols: GRPO's
update on every shard, PPO's stages in order, the critic's warm-up (its steps do not
move the policy; a resumed run makes none), and a step whose samples a shard lost."""

from __future__ import annotations

import anyio
from orchestrator_fakes import LOST, FakeTrainer

from async_rl.control.role_stages import PpoStages
from async_rl.control.run_health import RunHealth
from async_rl.control.step_metrics import StepTotals
from async_rl.control.step_stages import CRITIC_WARMUP, GrpoStages, StepUpdate
from buffers.common.reports import CriticStepResult
from buffers.common.train_records import ShardBatch, ShardStepResult


def batches(step: int, *, lost: bool = False, shards: int = 2) -> list[ShardBatch]:
    """One empty batch per shard; the last one's group unfetchable when ``lost``."""
    return [ShardBatch(step=step, groups=(LOST,) if lost and rank == shards - 1 else (),
                       micro_batches=(), updates=()) for rank in range(shards)]


def health(totals: StepTotals) -> RunHealth:
    return RunHealth(totals, max_nonfinite_steps=3, stall_timeout_s=60.0,
                     max_filtered_in_a_row=10)


class LoggedShard:
    """A shard's PPO stages (``RoleStagesClient``) logging each call."""

    def __init__(self, trainer: FakeTrainer, log: list[tuple[str, int, int]]) -> None:
        self.rank, self.log = trainer.rank, log
        self.lost: set[int] = set()
        train = trainer.train

        async def train_logged(batch: ShardBatch) -> ShardStepResult:
            self.log.append(("train", self.rank, batch.step))
            return await train(batch)

        trainer.train = train_logged  # type: ignore[method-assign]

    async def prepare_step(self, batch: ShardBatch) -> bool:
        self.log.append(("prepare", self.rank, batch.step))
        if LOST in batch.groups:
            self.lost.add(batch.step)
        return LOST in batch.groups

    async def reference_logprobs(self, step: int) -> None:
        self.log.append(("reference", self.rank, step))

    async def critic_values(self, step: int) -> None:
        self.log.append(("values", self.rank, step))

    async def advantages(self, step: int) -> None:
        self.log.append(("advantages", self.rank, step))

    async def critic_update(self, step: int) -> CriticStepResult:
        self.log.append(("critic_update", self.rank, step))
        return CriticStepResult(rank=self.rank, step=step, samples_lost=step in self.lost,
                                tokens=4, value_loss_sum=1.0)


def ppo(warmup: int, log: list[tuple[str, int, int]], totals: StepTotals
        ) -> tuple[PpoStages, list[FakeTrainer]]:
    trainers = [FakeTrainer(rank) for rank in range(2)]
    shards = [LoggedShard(trainer, log) for trainer in trainers]
    return PpoStages(shards, trainers, health(totals), warmup_steps=warmup), trainers


async def one_step(stages: GrpoStages | PpoStages, step: int, lost: bool = False
                   ) -> StepUpdate:
    work = batches(step, lost=lost)
    await stages.prepare(work, step)
    await stages.advantages(step)
    return await stages.update(work, step)


def test_grpo_updates_every_shard_and_moves_the_policy() -> None:
    trainers = [FakeTrainer(rank) for rank in range(2)]
    stages = GrpoStages(trainers, health(StepTotals()))
    update = anyio.run(one_step, stages, 1)
    assert [r.rank for r in update.results] == [0, 1]
    assert update.untrained == "" and update.critic == ()
    assert [t.steps for t in trainers] == [[1], [1]]
    assert not stages.warming_up


def test_grpo_step_with_samples_lost_does_not_move_the_policy() -> None:
    totals = StepTotals()
    update = anyio.run(one_step, GrpoStages([FakeTrainer(0), FakeTrainer(1)],
                                            health(totals)), 1, True)
    assert update.untrained == "samples_lost"
    assert totals.lost_steps == 1


def test_ppo_runs_the_dataflow_in_order_on_every_shard() -> None:
    log: list[tuple[str, int, int]] = []
    stages, _ = ppo(0, log, StepTotals())
    update = anyio.run(one_step, stages, 1)
    assert update.untrained == "" and len(update.results) == 2 and len(update.critic) == 2
    order = [name for name, rank, _ in log if rank == 0]
    assert order == ["prepare", "reference", "values", "advantages", "train",
                     "critic_update"]
    assert len(log) == 2 * len(order)


def test_ppo_warm_up_trains_the_critic_only_then_the_policy() -> None:
    log: list[tuple[str, int, int]] = []
    stages, trainers = ppo(1, log, StepTotals())
    assert stages.warming_up
    warm = anyio.run(one_step, stages, 1)
    assert warm.untrained == CRITIC_WARMUP and warm.results == ()
    assert len(warm.critic) == 2 and not stages.warming_up
    assert not any(name == "train" for name, *_ in log)
    trained = anyio.run(one_step, stages, 2)
    assert trained.untrained == "" and [t.steps for t in trainers] == [[2], [2]]


def test_a_warm_up_step_with_samples_lost_is_taken_anew() -> None:
    totals = StepTotals()
    stages, _ = ppo(1, [], totals)
    update = anyio.run(one_step, stages, 1, True)
    assert update.untrained == "samples_lost"
    assert stages.warming_up  # the warm-up step is still owed
    assert totals.lost_steps == 0  # the policy's update was not made, so not lost


def test_a_lost_ppo_step_after_warm_up_is_the_health_rules() -> None:
    totals = StepTotals()
    stages, trainers = ppo(0, [], totals)
    update = anyio.run(one_step, stages, 1, True)
    assert update.untrained == "samples_lost" and totals.lost_steps == 1
    assert [t.steps for t in trainers] == [[1], []]  # the shard that lost trained nothing


def test_a_resumed_run_makes_no_warm_up() -> None:
    stages, _ = ppo(2, [], StepTotals())
    stages.resumed()
    assert not stages.warming_up
    assert anyio.run(one_step, stages, 3).untrained == ""
