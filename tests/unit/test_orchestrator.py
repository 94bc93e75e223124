"""The orchestrator's loops, run for real against in-process fake workers (no Ray):
the staleness bound, stale drops, lost workers and samples, stop and resume, restarts."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import msgspec
import pytest
from orchestrator_fakes import (
    LOST,
    FakeEvaluator,
    FakeRollout,
    FakeTrainer,
    config,
    ledger,
    restored_and_trained,
    run,
    trained_once_or_unfinished,
)

from async_rl.control.checkpoint_files import latest_checkpoint
from async_rl.control.failures import RunFailed
from async_rl.run.run_dir import FINAL_MODEL, SPANS
from buffers.common.records import Group, Prompt
from buffers.common.train_records import ShardBatch, ShardStepResult


def test_a_run_trains_every_step_within_the_staleness_bound(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=6, max_staleness=1)
    rollout = {0: FakeRollout(0), 1: FakeRollout(1, delay=0.003)}
    trainers = [FakeTrainer(0), FakeTrainer(1)]
    cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer,
                                                                       num_shards=2))
    summary = run(cfg, rollout, trainers)
    assert summary.steps == summary.final_version == 6
    assert summary.groups_trained == 6 * cfg.trainer.groups_per_step
    assert summary.samples_trained == 4 * summary.groups_trained
    assert 1 <= len(summary.staleness_histogram) <= 2  # staleness 0 or 1, never more
    assert trainers[0].steps == trainers[1].steps == [1, 2, 3, 4, 5, 6]
    counts = trained_once_or_unfinished(ledger(tmp_path))
    assert counts["trained"] == summary.groups_trained
    assert rollout[0].generated + rollout[1].generated == counts["generated"]
    # Evaluations at steps 0, 2, 4, 6: the due ones during training, and both ends.
    evals = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert {e["step"] for e in evals} >= {0, 6}
    assert summary.rollout_version == 6
    assert (tmp_path / FINAL_MODEL).is_dir()


def test_an_evaluator_scores_exactly_each_due_version_and_a_failure_costs_one_row(
    tmp_path: Path,
) -> None:
    """run.eval_on = "idle_cpu": each due version's weights are taken the moment it is
    trained (before the next step), so a row's version is exactly its step; a failed
    evaluation loses its row only. The rollout engines evaluate nothing."""
    cfg = config(tmp_path, steps=6, max_staleness=1)  # eval_every 2
    evaluator = FakeEvaluator(fails=frozenset({4}))
    rollout = {0: FakeRollout(0)}
    evaluations: list[int] = []

    async def counted(prompts: object) -> None:
        evaluations.append(1)
        raise AssertionError("a rollout worker evaluated")

    rollout[0].evaluate = counted  # type: ignore[assignment,method-assign]
    summary = run(cfg, rollout, [FakeTrainer(0)], evaluator=evaluator)
    assert summary.steps == 6 and not evaluations
    assert [w.version for w in evaluator.scored] == [0, 2, 6]
    # Taken right after training the version: exactly that many steps in the weights.
    assert [w.steps_trained for w in evaluator.scored] == [(), (1, 2), (1, 2, 3, 4, 5, 6)]
    evals = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["version_min"], e["version"]) for e in evals] == [
        (0, 0, 0), (2, 2, 2), (6, 6, 6)]


SLOW = frozenset(f"arith-{i}" for i in range(0, 12, 3))
"""Prompts whose first attempt takes 100x longer: they finish out of order."""


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_slow_groups_go_stale_are_requeued_and_training_goes_on(
    tmp_path: Path, max_staleness: int,
) -> None:
    """Without queue.wait_for_expiring, groups that finish after the trainer moved past
    their bound are dropped at take time and their prompts run again: the slot comes
    back, so the gate never stays shut (without the release every drop would leak a
    slot and deadlock the run)."""
    cfg = config(tmp_path, steps=6, max_staleness=max_staleness, groups=2,
                 wait_for_expiring=False)
    summary = run(cfg, {0: FakeRollout(0, slow=SLOW)}, [FakeTrainer(0)], virtual=True)
    assert summary.steps == 6
    assert len(summary.staleness_histogram) <= max_staleness + 1  # the bound held
    events = ledger(tmp_path)
    counts = trained_once_or_unfinished(events)
    assert counts["trained"] == 12
    assert summary.dropped_stale == counts["dropped"] >= 1
    assert sum(b.dropped for b in summary.stale_drops_by_length) == summary.dropped_stale
    assert sum(b.groups for b in summary.stale_drops_by_length) == counts["generated"]
    dropped = [p for p, h in events.items() if any(e["event"] == "dropped" for e in h)]
    assert all(any(e["event"] == "requeued" for e in events[p]) for p in dropped)


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_slow_groups_are_waited_for_when_their_bound_is_near(
    tmp_path: Path, max_staleness: int,
) -> None:
    """With queue.wait_for_expiring (the default) the step that is a slow group's last
    chance waits for it: trained within the bound, none dropped."""
    cfg = config(tmp_path, steps=6, max_staleness=max_staleness, groups=2)
    summary = run(cfg, {0: FakeRollout(0, slow=SLOW)}, [FakeTrainer(0)], virtual=True)
    assert summary.steps == 6 and summary.dropped_stale == 0
    assert len(summary.staleness_histogram) <= max_staleness + 1
    events = ledger(tmp_path)
    assert trained_once_or_unfinished(events)["trained"] == 12
    assert all(any(e["event"] == "trained" for e in events[p]) for p in SLOW)


def test_a_dead_rollout_worker_is_retired_and_its_prompt_runs_elsewhere(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=4)
    rollout = {0: FakeRollout(0, dies_after=3), 1: FakeRollout(1)}
    summary = run(cfg, rollout, [FakeTrainer(0)])
    assert summary.steps == 4
    assert summary.retired_workers == 1
    assert summary.rollout_failures >= 1
    events = ledger(tmp_path)
    counts = trained_once_or_unfinished(events)
    failed = [p for p, h in events.items() if any(e["event"] == "failed" for e in h)]
    assert len(failed) >= 1
    assert counts["trained"] == 4 * cfg.trainer.groups_per_step
    assert all(any(e["event"] == "trained" for e in events[p]) or
               events[p][-1]["event"] == "unfinished" for p in failed)


def test_a_step_with_lost_samples_trains_nothing_and_its_prompts_run_again(
    tmp_path: Path,
) -> None:
    """A shard that cannot fetch a group (its rollout worker died after generating it)
    makes the whole step void: no version, the prompts re-queued, the step taken anew."""
    cfg = config(tmp_path, steps=3, max_staleness=2)

    class LosesTheSecondGroup(FakeRollout):
        async def generate(self, prompt: Prompt) -> Group:
            group = await super().generate(prompt)
            lost = self.generated == 2
            return msgspec.structs.replace(group, tokens=LOST) if lost else group

    trainer = FakeTrainer(0)
    summary = run(cfg, {0: LosesTheSecondGroup(0)}, [trainer])
    assert summary.steps == summary.final_version == 3
    assert summary.lost_steps == 1
    assert trainer.steps == [1, 2, 3]
    events = ledger(tmp_path)
    counts = trained_once_or_unfinished(events)
    assert counts["trained"] == 3 * cfg.trainer.groups_per_step
    lost = [p for p, h in events.items()
            if any(e.get("reason") == "samples_lost" for e in h)]
    assert len(lost) == cfg.trainer.groups_per_step  # the whole step's groups
    assert all(any(e["event"] == "trained" for e in events[p]) for p in lost)


def test_a_stopped_run_resumes_with_nothing_lost_or_trained_twice(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=6, max_staleness=2)
    first = run(cfg, {0: FakeRollout(0)}, [FakeTrainer(0)], stop_after=3)
    assert first.stopped == "SIGINT" and first.steps == first.final_version == 3
    assert not (tmp_path / "eval.jsonl").read_text().count('"step":6')
    # Slots not spent on trained groups come back, but the queued groups' the checkpoint
    # keeps: the resumed gate admits the rest.
    _, saved = latest_checkpoint(tmp_path)
    assert first.groups_trained == 3 * cfg.trainer.groups_per_step
    assert saved.gate.started == first.groups_trained + len(saved.queue)
    # At η = 2 the queue held groups of the next steps at the stop (the fakes are fast):
    # kept with their tokens, and owed no more.
    kept = {s.group.prompt_id for s in saved.queue}
    assert kept and all(s.tokens is not None for s in saved.queue)
    assert not kept & {p.prompt_id for p in saved.reissue}

    trainer = FakeTrainer(0)
    second = run(cfg, {0: FakeRollout(0)}, [trainer], resume=True)
    assert second.stopped == "" and second.steps == second.final_version == 6
    assert trainer.steps == [4, 5, 6]  # the resumed run started after the checkpoint
    assert second.groups_trained == 6 * cfg.trainer.groups_per_step  # counters carried
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # no duplicate step rows
    events = ledger(tmp_path)
    counts = trained_once_or_unfinished(events)
    assert counts["trained"] == 6 * cfg.trainer.groups_per_step
    # What was in flight at the stop (none here: no prompt is admitted once the stop's
    # step has trained, and the fakes are fast) is issued again, with the reason; the
    # queued ones are restored, and trained without being generated again.
    resumed = [p for p, h in events.items() if any(e["reason"] == "resume" for e in h)]
    assert set(resumed) >= kept
    assert all(events[p][-1]["event"] in ("trained", "unfinished") for p in resumed)
    assert restored_and_trained(events) == kept
    # The staleness bound holds across the resume (versions continue from 3).
    assert len(second.staleness_histogram) <= 3


def test_a_dead_only_rollout_worker_is_restarted_and_the_run_completes(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, steps=5)
    summary = run(cfg, {0: FakeRollout(0, dies_after=6)}, [FakeTrainer(0)],
                  restart=lambda rank: FakeRollout(rank))
    assert summary.steps == 5 and summary.restarts == 1
    counts = trained_once_or_unfinished(ledger(tmp_path))
    assert counts["trained"] == 5 * cfg.trainer.groups_per_step
    assert counts["failed"] >= 1  # what the dead worker held ran again


def test_past_max_restarts_the_run_fails_with_a_checkpoint(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=50)
    cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout,
                                                                       max_restarts=1))
    with pytest.raises(RunFailed, match="1 of 1 restarts used"):
        run(cfg, {0: FakeRollout(0, dies_after=6)}, [FakeTrainer(0)],
            restart=lambda rank: FakeRollout(rank, dies_after=6))
    _, state = latest_checkpoint(tmp_path)
    assert 1 <= state.version < 50
    assert state.counters.restarts == 1


class SlowWriter(FakeTrainer):
    """A shard whose checkpoint writes complete only once it has trained the next step
    (or after a second: the run's last checkpoint has no next step)."""

    def __init__(self, rank: int, run_dir: Path) -> None:
        super().__init__(rank)
        self.run_dir = run_dir
        self.trained = anyio.Event()
        self.renamed_before: dict[int, bool] = {}
        """Per step trained: whether a checkpoint folder was in place by then."""

    async def train(self, batch: ShardBatch) -> ShardStepResult:
        done = bool(list((self.run_dir / "checkpoints").glob("step-*")))
        self.renamed_before[batch.step] = done
        result = await super().train(batch)
        self.trained.set()
        return result

    async def save_checkpoint(self, out_dir: str) -> None:
        self.trained = anyio.Event()
        await super().save_checkpoint(out_dir)

    async def checkpoint_written(self) -> None:
        with anyio.move_on_after(1):
            await self.trained.wait()


def test_a_checkpoint_is_written_while_the_next_step_trains(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=4)
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, checkpoint_every=2))
    trainer = SlowWriter(0, tmp_path)
    summary = run(cfg, {0: FakeRollout(0)}, [trainer])
    assert summary.steps == 4
    # Step 3 started before checkpoint 2 was in place: its write ran beside it.
    assert trainer.renamed_before == {1: False, 2: False, 3: False, 4: True}
    folder, state = latest_checkpoint(tmp_path)
    assert folder.name == "step-000004" and state.trainer_backend == "ddp"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000002", "step-000004"]  # no partial folder left
    spans = [json.loads(line) for line in (tmp_path / SPANS).read_text().splitlines()]
    assert any("checkpoint" in span for span in spans)  # the controller's wait is named
