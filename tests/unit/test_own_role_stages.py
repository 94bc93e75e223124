"""The PPO dataflow with the reference and the critic on workers of their own
(placement "own"), on in-process fakes: the stages run on those workers, each trainer
shard takes its own share of their outputs (critic shard r serves trainer shards r,
r + N, ...), the critic's update is started before the policy's and awaited after it,
a step that any worker lost computes nothing anywhere, the warm-up trains the critic
only, the roles' workers are read for usage and spans, and a dead critic worker stops
the run in one line with a checkpoint from the live trainer shards."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from orchestrator_fakes import LOST, FakeRollout, FakeTrainer, config, run

from async_rl.config import Config
from async_rl.control.checkpoint_files import latest_checkpoint
from async_rl.control.failures import RoleFailed, RunFailed
from async_rl.control.protocols import OwnRoles, RoleOutput
from async_rl.run.run_dir import read_metrics
from buffers.common.reports import CriticStepResult, UsageReading
from buffers.common.train_records import ShardBatch, ShardStepResult
from workers.common.spans import Span

Log = list[tuple[Any, ...]]


class Output(msgspec.Struct, frozen=True):
    """A fake ``RoleOutput``: which worker made it, for the ``index``-th batch it was
    given, at which step."""

    worker: str
    index: int
    step: int


class FakeShardStages:
    """A trainer shard's stages: records what it is asked and what it takes."""

    def __init__(self, trainer: FakeTrainer, log: Log) -> None:
        self.rank, self.log = trainer.rank, log
        self.told_lost: set[int] = set()
        self.batches: dict[int, ShardBatch] = {}
        train = trainer.train

        async def train_logged(batch: ShardBatch) -> ShardStepResult:
            self.log.append(("train", batch.step, self.rank))
            result = await train(batch)
            if batch.step in self.told_lost:  # the shards agree in their first all-reduce
                self.told_lost.discard(batch.step)
                return msgspec.structs.replace(result, samples_lost=True)
            return result

        trainer.train = train_logged  # type: ignore[method-assign]

    async def prepare_step(self, batch: ShardBatch) -> bool:
        self.batches[batch.step] = batch
        return any(g == LOST for g in batch.groups)

    async def reference_logprobs(self, step: int) -> None:
        raise AssertionError("the reference has its own worker")

    async def critic_values(self, step: int) -> None:
        raise AssertionError("the critic has its own workers")

    async def advantages(self, step: int) -> None:
        raise AssertionError("the critic has its own workers")

    async def critic_update(self, step: int) -> CriticStepResult:
        raise AssertionError("the critic has its own workers")

    async def take_reference(self, step: int, logprobs: RoleOutput) -> None:
        self.log.append(("take_reference", step, self.rank, logprobs))

    async def take_advantages(self, step: int, advantages: RoleOutput) -> None:
        self.log.append(("take_advantages", step, self.rank, advantages))

    async def policy_logprobs(self, step: int) -> RoleOutput:
        self.log.append(("policy", step, self.rank))
        return Output(f"trainer-{self.rank}", 0, step)

    async def step_lost(self, step: int) -> None:
        self.told_lost.add(step)
        self.log.append(("step_lost", step, self.rank))


class FakeOwn:
    """What every fake role worker reports, and the batches it prepared."""

    def __init__(self, name: str, log: Log, lose: set[int] | None = None) -> None:
        self._name, self.log = name, log
        self.lose = lose or set()
        """Steps whose groups this worker cannot fetch the first time (the step taken
        anew has other groups)."""
        self.batches: dict[int, list[ShardBatch]] = {}

    @property
    def name(self) -> str:
        return self._name

    async def mean_cores(self) -> float:
        return 1.0

    async def usage(self) -> UsageReading:
        self.log.append(("usage", 0, self._name))
        return UsageReading(wall=0.0, cpu_s=0.0)

    async def spans(self) -> list[Span]:
        return [Span(worker=self._name, role=self._name.split("-")[0], rank=0,
                     device="cpu:0", cause="forward", start=1.0, end=2.0, version=0)]

    async def prepare_step(self, batches: Sequence[ShardBatch]) -> bool:
        step = batches[0].step
        self.log.append(("prepare", step, self._name))
        self.batches[step] = list(batches)
        if step in self.lose:
            self.lose.discard(step)
            return True
        return any(g == LOST for b in batches for g in b.groups)

    def outputs(self, step: int) -> list[RoleOutput]:
        return [Output(self._name, index, step) for index in range(len(self.batches[step]))]


class FakeReference(FakeOwn):
    async def reference_logprobs(self, step: int) -> list[RoleOutput]:
        self.log.append(("reference", step))
        return self.outputs(step)


class Pending:
    def __init__(self, critic: FakeCritic, step: int) -> None:
        self.critic, self.step = critic, step

    async def result(self) -> CriticStepResult:
        self.critic.log.append(("critic_result", self.step, self.critic.name))
        return CriticStepResult(rank=self.critic.rank, step=self.step, tokens=10,
                                value_loss_sum=2.0, clipped=1, value_sum=3.0,
                                return_sum=5.0, grad_norm=0.5)


class FakeCritic(FakeOwn):
    def __init__(self, rank: int, log: Log) -> None:
        super().__init__(f"critic-{rank}", log)
        self.rank = rank
        self.references: dict[int, tuple[RoleOutput, ...]] = {}
        self.policies: dict[int, tuple[RoleOutput, ...]] = {}

    async def critic_values(self, step: int) -> None:
        self.log.append(("values", step, self.name))

    async def advantages(self, step: int, reference: Sequence[RoleOutput],
                         policy: Sequence[RoleOutput]) -> list[RoleOutput]:
        self.log.append(("advantages", step, self.name))
        self.references[step] = tuple(reference)
        self.policies[step] = tuple(policy)
        return self.outputs(step)

    def start_update(self, step: int) -> Pending:
        self.log.append(("critic_start", step, self.name))
        return Pending(self, step)

    async def save_checkpoint(self, out_dir: str) -> None:
        self.log.append(("critic_save", 0, self.name))


def ppo(tmp_path: Path, *, shards: int, critics: int, warmup: int = 0) -> Config:
    base = msgspec.to_builtins(config(tmp_path, steps=2, groups=shards))
    base["algorithm"] = {"advantage": "gae"}
    base["critic"] = {"warmup_steps": warmup, "placement": "own", "num_shards": critics}
    base["reference"] = {"placement": "own"}
    base["trainer"] |= {"kl_coef": 0.1, "kl_in_reward": True, "num_shards": shards}
    return msgspec.convert(base, Config)


class Roles:
    """A run's fakes: trainer shards with their stages, the reference, the critics."""

    def __init__(self, *, shards: int, critics: int, lose: set[int] | None = None) -> None:
        self.log: Log = []
        self.trainers = [FakeTrainer(rank) for rank in range(shards)]
        self.stages = [FakeShardStages(t, self.log) for t in self.trainers]
        self.reference = FakeReference("reference-0", self.log, lose)
        self.critics = [FakeCritic(rank, self.log) for rank in range(critics)]
        self.own = OwnRoles(reference=self.reference, critics=list(self.critics),
                            shards=list(self.stages), reference_to_critic=True)

    def run(self, cfg: Config) -> Any:
        return run(cfg, {0: FakeRollout(0)}, self.trainers, stages=self.stages, own=self.own)

    def names(self, step: int) -> list[str]:
        return [entry[0] for entry in self.log if entry[1] == step]


def test_own_roles_compute_the_stages_and_hand_each_shard_its_share(tmp_path: Path) -> None:
    roles = Roles(shards=4, critics=2)
    summary = roles.run(ppo(tmp_path, shards=4, critics=2))
    assert summary.final_version == 2
    for step in (1, 2):
        names = roles.names(step)
        # The dataflow in order; the critic's update starts before the policy's and is
        # awaited after it.
        firsts = [names.index(n) for n in ("prepare", "reference", "take_reference", "values",
                                           "advantages", "take_advantages", "critic_start",
                                           "train", "critic_result")]
        assert firsts == sorted(firsts)
        assert max(i for i, n in enumerate(names) if n == "critic_start") < names.index("train")
        assert max(i for i, n in enumerate(names) if n == "train") < names.index("critic_result")
        batches = [stage.batches[step] for stage in roles.stages]
        assert roles.reference.batches[step] == batches  # every shard's batch
        taken = {entry[2]: entry[3] for entry in roles.log
                 if entry[0] == "take_reference" and entry[1] == step}
        assert taken == {s: Output("reference-0", s, step) for s in range(4)}
        for rank, critic in enumerate(roles.critics):
            # Critic shard r fits trainer shards r, r + 2: their batches, their
            # reference logprobs and their policies' (from the shards: the KL in the
            # reward is the trainer's policy's).
            assert critic.batches[step] == batches[rank::2]
            assert critic.references[step] == tuple(
                Output("reference-0", s, step) for s in range(rank, 4, 2))
            assert critic.policies[step] == tuple(
                Output(f"trainer-{s}", 0, step) for s in range(rank, 4, 2))
        assert names.index("policy") < names.index("advantages")
        advantages = {entry[2]: entry[3] for entry in roles.log
                      if entry[0] == "take_advantages" and entry[1] == step}
        assert advantages == {s: Output(f"critic-{s % 2}", s // 2, step) for s in range(4)}
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for row in rows:  # two critic shards' results summed
        assert row["critic/value_loss"] == 0.2 and row["critic/return_mean"] == 0.5
    # The roles' workers are read for usage, their spans reach the run's record.
    assert {e[2] for e in roles.log if e[0] == "usage"} >= {"reference-0", "critic-0",
                                                            "critic-1"}
    spans = (tmp_path / "spans.jsonl").read_text()
    assert "reference-0" in spans and "critic-1" in spans


def test_a_step_an_own_worker_lost_computes_nothing_and_is_taken_anew(tmp_path: Path) -> None:
    roles = Roles(shards=2, critics=1, lose={1})
    summary = roles.run(ppo(tmp_path, shards=2, critics=1))
    assert summary.final_version == 2
    names = roles.names(1)
    # The shards kept their groups but were told; nothing else ran for that attempt
    # (the policy's update found the step lost and trained nothing).
    first = names[:names.index("train") + 2]
    assert sorted(first) == ["prepare"] * 2 + ["step_lost"] * 2 + ["train"] * 2
    assert names.count("prepare") == 4 and names.count("train") == 4
    # The step was taken anew with fresh groups and trained both roles.
    assert names[len(first):].count("critic_result") == 1
    assert [e[1] for e in roles.log if e[0] == "critic_result"] == [1, 2]
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]


def test_the_warm_up_trains_the_own_critic_only(tmp_path: Path) -> None:
    roles = Roles(shards=1, critics=1)
    summary = roles.run(ppo(tmp_path, shards=1, critics=1, warmup=1))
    assert summary.final_version == 2
    # Step 1 twice: the warm-up (no policy update), then for the policy.
    names = roles.names(1)
    assert names.count("critic_result") == 2 and names.count("train") == 1
    assert names.index("critic_result") < names.index("train")


class DyingCritic(FakeCritic):
    """Its process dies as it computes the values of ``step``."""

    def __init__(self, rank: int, log: Log, step: int) -> None:
        super().__init__(rank, log)
        self.dies_at = step

    async def critic_values(self, step: int) -> None:
        if step == self.dies_at:
            raise RoleFailed("critic-0", f"values of step {step}: RayActorError", dead=True)
        await super().critic_values(step)


def test_a_dead_own_critic_stops_the_run_in_one_line_with_a_checkpoint(
        tmp_path: Path) -> None:
    roles = Roles(shards=1, critics=0)
    roles.critics = [DyingCritic(0, roles.log, step=2)]
    roles.own = OwnRoles(reference=roles.reference, critics=list(roles.critics),
                         shards=list(roles.stages), reference_to_critic=True)
    with pytest.raises(RunFailed) as failed:
        roles.run(ppo(tmp_path, shards=1, critics=1))
    message = str(failed.value)
    assert "\n" not in message and message.startswith("critic-0 died: values of step 2")
    # The trainer shard is alive: it writes the checkpoint of the last completed step.
    assert "checkpoint of step 1 written" in message
    folder, state = latest_checkpoint(tmp_path)
    assert state.version == 1 and folder.is_dir()
