"""Failures the orchestrator survives, counts, or stops on with a checkpoint and one line,
run against in-process fakes (no Ray): non-finite steps, a stalled rollout, a dead
trainer shard (and resuming after it), a worker lost during evaluation, and the
deadlines the Ray adapters put on every call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from orchestrator_fakes import (
    FakeRollout,
    FakeTrainer,
    config,
    ledger,
    run,
    trained_once_or_unfinished,
)

from async_rl.config import Config
from async_rl.control.checkpoint_files import latest_checkpoint
from async_rl.control.failures import RolloutFailed, RunFailed, TrainerFailed, WaitTimedOut
from async_rl.shell import adapted_workers, adapters
from async_rl.shell.adapters import RayRollout, RayTrainer
from async_rl.shell.launch import StartedWorkers
from buffers.common.records import Prompt
from buffers.common.reports import EvalResult
from buffers.common.train_records import ShardBatch, ShardStepResult


def with_keys(cfg: Config, **sections: dict[str, Any]) -> Config:
    """``cfg`` with some keys of some sections replaced."""
    return msgspec.structs.replace(cfg, **{
        name: msgspec.structs.replace(getattr(cfg, name), **keys)
        for name, keys in sections.items()})


def summary_json(run_dir: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return summary


class NonFiniteAt(FakeTrainer):
    """Reports a non-finite gradient (update skipped) on the given calls (1-based)."""

    def __init__(self, rank: int, calls: set[int] | None = None, after: int = 0) -> None:
        super().__init__(rank)
        self.calls, self.after, self.count = calls or set(), after, 0

    async def train(self, batch: ShardBatch) -> ShardStepResult:
        self.count += 1
        result = await super().train(batch)
        if self.count in self.calls or (self.after and self.count > self.after):
            self.steps.pop()  # nothing was trained
            return msgspec.structs.replace(result, nonfinite=True, grad_norm=float("nan"))
        return result


def test_a_nonfinite_step_trains_nothing_and_its_prompts_run_again(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=4)
    trainer = NonFiniteAt(0, calls={2})
    summary = run(cfg, {0: FakeRollout(0)}, [trainer])
    assert summary.steps == summary.final_version == 4
    assert trainer.steps == [1, 2, 3, 4]  # step 2 taken again after the skipped update
    assert summary.nonfinite_steps == summary.failures["nonfinite_steps"] == 1
    events = ledger(tmp_path)
    counts = trained_once_or_unfinished(events)
    assert counts["trained"] == 4 * cfg.trainer.groups_per_step
    again = [p for p, h in events.items() if any(e["reason"] == "nonfinite" for e in h)]
    assert len(again) == cfg.trainer.groups_per_step
    assert all(any(e["event"] == "trained" for e in events[p]) for p in again)


def test_nonfinite_steps_in_a_row_stop_the_run_with_a_checkpoint(tmp_path: Path) -> None:
    cfg = with_keys(config(tmp_path, steps=20), trainer={"max_nonfinite_steps": 3})
    with pytest.raises(RunFailed, match=r"^3 steps in a row had a non-finite gradient "
                       r".*checkpoint of step 2 written \[failures: .*nonfinite_steps 3"):
        run(cfg, {0: FakeRollout(0)}, [NonFiniteAt(0, after=2)])
    _, state = latest_checkpoint(tmp_path)
    assert state.version == 2
    assert summary_json(tmp_path)["stopped"].startswith("failed: 3 steps in a row")


class HangsAfter(FakeRollout):
    """Generates ``groups`` groups, then never answers again."""

    def __init__(self, rank: int, groups: int) -> None:
        super().__init__(rank)
        self.groups, self.calls = groups, 0

    async def generate(self, prompt: Prompt) -> Any:
        self.calls += 1
        if self.calls > self.groups:
            await anyio.sleep_forever()
        return await super().generate(prompt)


def test_a_stalled_rollout_is_a_named_failure_not_a_hang(tmp_path: Path) -> None:
    cfg = with_keys(config(tmp_path, steps=10), rollout={"stall_timeout_s": 0.5})
    with pytest.raises(RunFailed, match=r"^rollout stall: no group generated and no step "
                       r"trained for \d+ s \(rollout.stall_timeout_s = 0.5\)"):
        run(cfg, {0: HangsAfter(0, groups=9)}, [FakeTrainer(0)])
    summary = summary_json(tmp_path)
    assert summary["failures"]["rollout_stall"] == 1
    assert summary["steps"] == 2  # 9 groups made two steps of 4
    assert latest_checkpoint(tmp_path)[1].version == 2


class DiesAt(FakeTrainer):
    """A trainer shard whose process dies during step ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        super().__init__(rank)
        self.dies_at = step

    async def train(self, batch: ShardBatch) -> ShardStepResult:
        if batch.step == self.dies_at:
            raise TrainerFailed(self.rank, f"step {batch.step}: ActorDiedError", dead=True)
        return await super().train(batch)


def test_a_dead_trainer_shard_stops_the_run_with_a_checkpoint_and_resume_continues(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, steps=6, shards=2)
    with pytest.raises(RunFailed, match=r"^trainer-1 died: step 4: ActorDiedError; "
                       r"checkpoint of step 3 written"):
        run(cfg, {0: FakeRollout(0)}, [FakeTrainer(0), DiesAt(1, step=4)])
    _, state = latest_checkpoint(tmp_path)
    assert state.version == 3  # the last completed step, from the live shard 0
    trainers = [FakeTrainer(0), FakeTrainer(1)]
    resumed = run(cfg, {0: FakeRollout(0)}, trainers, resume=True)
    assert resumed.steps == resumed.final_version == 6
    assert trainers[0].steps == [4, 5, 6]
    counts = trained_once_or_unfinished(ledger(tmp_path))
    assert counts["trained"] == 6 * cfg.trainer.groups_per_step


def test_the_only_trainer_shard_dead_leaves_the_newest_periodic_checkpoint(
    tmp_path: Path,
) -> None:
    cfg = with_keys(config(tmp_path, steps=6), run={"checkpoint_every": 2})
    with pytest.raises(RunFailed, match="no live trainer shard to write a checkpoint from"):
        run(cfg, {0: FakeRollout(0)}, [DiesAt(0, step=4)])
    assert latest_checkpoint(tmp_path)[1].version == 2
    trainer = FakeTrainer(0)
    resumed = run(cfg, {0: FakeRollout(0)}, [trainer], resume=True)
    assert trainer.steps == [3, 4, 5, 6]  # step 3 was trained before, but is cut back
    assert resumed.steps == 6
    counts = trained_once_or_unfinished(ledger(tmp_path))
    assert counts["trained"] == 6 * cfg.trainer.groups_per_step


class DiesInEvaluation(FakeRollout):
    """Dies the first time it is asked to evaluate after training started."""

    async def evaluate(self, prompts: Any) -> EvalResult:
        if self.generated:
            self.dead = True
            raise RolloutFailed("RayActorError", worker_gone=True)
        return await super().evaluate(prompts)


def test_a_worker_lost_during_evaluation_is_replaced_and_the_evaluation_runs_again(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, steps=4)  # evaluations at 0, 2 and 4
    summary = run(cfg, {0: DiesInEvaluation(0)}, [FakeTrainer(0)],
                  restart=lambda rank: FakeRollout(rank))
    assert summary.steps == 4 and summary.restarts == 1
    steps = [json.loads(x)["step"] for x in (tmp_path / "eval.jsonl").read_text().split()]
    assert steps == [0, 2, 4]  # no evaluation row lost
    assert summary.accuracy_end is not None


class Silent:
    """A Ray actor handle whose every method call never answers."""

    def __getattr__(self, method: str) -> Any:
        class Method:
            @staticmethod
            def remote(*args: Any) -> Any:
                return anyio.sleep_forever()

        return Method


def test_every_worker_call_has_a_deadline_that_names_what_was_waited_for(
    tmp_path: Path,
) -> None:
    cfg = with_keys(config(tmp_path), run={"call_timeout_s": 0.05},
                    rollout={"generate_timeout_s": 0.05}, trainer={"step_timeout_s": 0.05})
    trainer, rollout = RayTrainer(0, Silent(), cfg), RayRollout("rollout-0", Silent(), cfg)
    prompt = Prompt(prompt_id="p", text="", answer="")

    async def main() -> None:
        with pytest.raises(WaitTimedOut, match=r"^timed out after 0.05 s waiting for "
                           r"trainer-0.save_checkpoint \(run.call_timeout_s\)$"):
            await trainer.save_checkpoint("x")
        with pytest.raises(RolloutFailed, match=r"no answer to generate_group_ref after "
                           r"0.05 s \(rollout.generate_timeout_s\)") as failed:
            await rollout.generate(prompt)
        assert failed.value.worker_gone and failed.value.timed_out
        batch = ShardBatch(step=3, groups=(), micro_batches=(), updates=(0,))
        with pytest.raises(TrainerFailed, match=r"^trainer-0 died: no answer to step 3 "
                           r"after 0.05 s \(trainer.step_timeout_s\)$") as stuck:
            await trainer.train(batch)
        assert stuck.value.dead and stuck.value.timed_out

    anyio.run(main)


class Starts:
    """A Ray actor handle whose every method call answers at once."""

    def __getattr__(self, method: str) -> Any:
        class Method:
            @staticmethod
            async def remote(*args: Any) -> None:
                return None

        return Method


def test_a_replacements_start_and_connect_have_their_deadlines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = with_keys(config(tmp_path), run={"call_timeout_s": 0.05},
                    trainer={"step_timeout_s": 0.1})
    killed: list[Any] = []
    monkeypatch.setattr(adapters.ray, "kill", killed.append)
    hangs, starts = Silent(), Starts()

    async def restart(new: Any, shard: Any) -> RayRollout:
        started = StartedWorkers(new_rollout=lambda *args: new)
        return await adapted_workers.restart_rollout(
            started, RayTrainer(0, shard, cfg), 1, cfg.model, 3, cfg)

    async def main() -> None:
        with pytest.raises(RolloutFailed, match=r"^no answer to start after 0.05 s "
                           r"\(run.call_timeout_s\)$") as failed:
            await restart(hangs, starts)
        assert failed.value.worker_gone and failed.value.timed_out
        assert killed == [hangs]  # it must not keep its cores
        with pytest.raises(WaitTimedOut, match=r"^timed out after 0.1 s waiting for "
                           r"trainer-0.connect_rollout \(trainer.step_timeout_s\)$"):
            await restart(starts, hangs)
        worker = await restart(starts, starts)
        assert worker.name == "rollout-1" and worker.handle is starts

    anyio.run(main)


class BreaksAtStep(FakeTrainer):
    """A shard whose step raises an error no rule expects (a bug, say)."""

    async def train(self, batch: ShardBatch) -> ShardStepResult:
        if batch.step == 3:
            raise KeyError("no such tensor")
        return await super().train(batch)


def test_an_unexpected_error_stops_the_run_in_one_line_with_its_traceback_kept(
    tmp_path: Path,
) -> None:
    with pytest.raises(RunFailed, match=r"^unexpected KeyError: 'no such tensor' \(traceback "
                       r"in .*error.log\); checkpoint of step 2 written$"):
        run(config(tmp_path, steps=6), {0: FakeRollout(0)}, [BreaksAtStep(0)])
    assert "KeyError: 'no such tensor'" in (tmp_path / "error.log").read_text()
    assert latest_checkpoint(tmp_path)[1].version == 2
    assert summary_json(tmp_path)["stopped"].startswith("failed: unexpected KeyError")
