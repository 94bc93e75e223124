"""The orchestrator's PPO dataflow on in-process fakes: each step calls the stages in
order (prepare, reference logprobs, critic values, advantages, policy update, critic
update, then publish), critic.warmup_steps steps train the critic only and run their
prompts again, lost groups train nothing, and the roles' metrics reach each row."""

from __future__ import annotations

from pathlib import Path

import msgspec
from orchestrator_fakes import LOST, FakeRollout, FakeTrainer, config, ledger, run

from async_rl.config import Config
from async_rl.run.run_dir import read_metrics
from buffers.common.records import Group, Prompt
from buffers.common.reports import CriticStepResult
from buffers.common.train_records import ShardBatch, ShardStepResult


class FakeStages:
    """Records each stage call in a log shared with its trainer shard."""

    def __init__(self, trainer: FakeTrainer, log: list[tuple[str, int]]) -> None:
        self.log = log
        self.lost: set[int] = set()
        train = trainer.train

        async def train_logged(batch: ShardBatch) -> ShardStepResult:
            self.log.append(("train", batch.step))
            return await train(batch)

        trainer.train = train_logged  # type: ignore[method-assign]

    async def prepare_step(self, batch: ShardBatch) -> bool:
        self.log.append(("prepare", batch.step))
        lost = any(g == LOST for g in batch.groups)
        if lost:
            self.lost.add(batch.step)
        return lost

    async def reference_logprobs(self, step: int) -> None:
        self.log.append(("reference", step))

    async def critic_values(self, step: int) -> None:
        self.log.append(("values", step))

    async def advantages(self, step: int) -> None:
        self.log.append(("advantages", step))

    async def critic_update(self, step: int) -> CriticStepResult:
        self.log.append(("critic_update", step))
        if step in self.lost:
            return CriticStepResult(rank=0, step=step, samples_lost=True)
        return CriticStepResult(rank=0, step=step, tokens=10, value_loss_sum=2.0,
                                clipped=1, value_sum=3.0, return_sum=5.0, grad_norm=0.5)


def ppo(tmp_path: Path, warmup: int) -> Config:
    base = msgspec.to_builtins(config(tmp_path, steps=3))
    base["algorithm"] = {"advantage": "gae"}
    base["critic"] = {"warmup_steps": warmup}
    base["trainer"] |= {"kl_coef": 0.1}
    return msgspec.convert(base, Config)


ORDER = ["prepare", "reference", "values", "advantages", "train", "critic_update"]


def test_each_step_runs_the_stages_in_order_after_the_critics_warm_up(tmp_path: Path) -> None:
    log: list[tuple[str, int]] = []
    trainer = FakeTrainer(0)
    stages = FakeStages(trainer, log)
    summary = run(ppo(tmp_path, warmup=2), {0: FakeRollout(0)}, [trainer], stages=[stages])
    assert summary.final_version == 3
    warm = ["prepare", "reference", "values", "advantages", "critic_update"]
    assert [name for name, _ in log] == warm * 2 + ORDER * 3
    assert [step for _, step in log] == [1] * 10 + [1] * 6 + [2] * 6 + [3] * 6
    assert trainer.steps == [1, 2, 3]
    events = [e for entries in ledger(tmp_path).values() for e in entries]
    assert sum(e["event"] == "dropped" and e.get("reason") == "critic_warmup"
               for e in events) == 2 * 4
    rows = read_metrics(tmp_path)
    assert len(rows) == 3
    for row in rows:
        assert row["critic/value_loss"] == 0.2 and row["critic/clip_fraction"] == 0.1
        assert row["critic/value_mean"] == 0.3 and row["critic/return_mean"] == 0.5
        assert row["kl/mean"] == 0.0 and row["kl/max"] == 0.0  # the fake measures none


def test_grpo_without_roles_calls_no_stage(tmp_path: Path) -> None:
    trainer = FakeTrainer(0)
    summary = run(config(tmp_path, steps=2), {0: FakeRollout(0)}, [trainer])
    assert summary.final_version == 2 and trainer.steps == [1, 2]
    assert not any(key.startswith(("critic/", "kl/")) for key in read_metrics(tmp_path)[0])


def test_a_step_whose_groups_were_lost_trains_neither_role(tmp_path: Path) -> None:
    log: list[tuple[str, int]] = []
    trainer = FakeTrainer(0)
    stages = FakeStages(trainer, log)

    class LosesTheSecondGroup(FakeRollout):
        async def generate(self, prompt: Prompt) -> Group:
            group = await super().generate(prompt)
            return (msgspec.structs.replace(group, tokens=LOST) if self.generated == 2
                    else group)

    summary = run(ppo(tmp_path, warmup=0), {0: LosesTheSecondGroup(0)}, [trainer],
                  stages=[stages])
    assert summary.final_version == 3 and trainer.steps == [1, 2, 3]
    assert stages.lost  # a step lost its groups, made no update, and was taken anew
    lost_step = min(stages.lost)
    assert ("train", lost_step) in log and ("critic_update", lost_step) in log
    assert [name for name, _ in log[-6:]] == ORDER
