"""The orchestrator's loops, run for real against in-process fake workers (no Ray).

The fakes implement ``async_rl.protocols`` the simplest way that keeps the contracts a
real worker keeps: a rollout fake labels its tokens with the version it runs and sleeps
to make groups finish out of order; a trainer fake resolves its batch's in-process
tokens; the weight fake delivers a version by setting it on every live rollout fake.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import msgspec
import pytest

from async_rl.checkpoint import latest_checkpoint
from async_rl.config import Config
from async_rl.orchestrator import Orchestrator
from async_rl.protocols import RolloutFailed, RunFailed, Workers
from async_rl.records import (
    BroadcastTiming,
    EvalResult,
    Group,
    LossStats,
    Prompt,
    Sample,
    ShardBatch,
    ShardStepResult,
    UsageReading,
    make_group,
)
from async_rl.run_dir import FINAL_MODEL, RunSummary, RunWriter
from async_rl.spans import Span
from async_rl.tasks import ArithmeticTask

LOST = "lost"
"""A group's ``tokens`` after its (fake) rollout worker died: unfetchable."""


class FakeRollout:
    """Generates a group per prompt after ``delay(prompt)`` seconds at its current version."""

    def __init__(self, rank: int, *, delay: float = 0.001, slow: frozenset[str] = frozenset(),
                 dies_after: int | None = None) -> None:
        self.rank, self.version_now = rank, 0
        self.delay, self.slow, self.dies_after = delay, slow, dies_after
        self.generated = 0
        self.dead = False

    @property
    def name(self) -> str:
        return f"rollout-{self.rank}"

    async def generate(self, prompt: Prompt) -> Group:
        if self.dead or (self.dies_after is not None and self.generated >= self.dies_after):
            self.dead = True
            raise RolloutFailed("RayActorError", worker_gone=True)
        started = self.version_now
        slow = prompt.prompt_id in self.slow and prompt.attempt == 0
        await anyio.sleep(0.2 if slow else self.delay)
        self.generated += 1
        samples = tuple(Sample(token_ids=(5, 6, 7)[: 1 + k % 3], logprobs=(-0.5,) * (1 + k % 3),
                               versions=(started,) * (1 + k % 3), finish_reason="stop",
                               text="x", reward=float(k % 2)) for k in range(4))
        return make_group(prompt, (1, 2), samples, rollout_rank=self.rank)

    async def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        return EvalResult(accuracy=0.5, version_min=self.version_now,
                          version_max=self.version_now, num_prompts=len(prompts),
                          rollout_rank=self.rank, seconds=0.0)

    async def version(self) -> int:
        return self.version_now

    async def busy_seconds(self) -> float:
        return 0.0

    async def usage(self) -> UsageReading:
        return UsageReading(wall=0.0, cpu_s=0.0)

    async def spans(self) -> list[Span]:
        return []


class FakeTrainer:
    """Trains nothing; checks its batch resolves, and reports lost samples like a shard."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps: list[int] = []

    @property
    def name(self) -> str:
        return f"trainer-{self.rank}"

    async def train(self, batch: ShardBatch) -> ShardStepResult:
        lost = any(g == LOST for g in batch.groups)
        tokens = 0 if lost else sum(len(s.completion_token_ids) for mb in
                                    batch.sequences(batch.groups) for s in mb)
        if not lost:
            self.steps.append(batch.step)
        return ShardStepResult(rank=self.rank, step=batch.step, grad_norm=1.0,
                               loss=LossStats(tokens=tokens, loss_sum=0.0, clipped=0,
                                              is_weight_sum=float(tokens),
                                              is_weight_sq_sum=float(tokens),
                                              is_weight_max=1.0, kl_sum=0.0),
                               forward_s=0.0, backward_s=0.0, optimizer_s=0.0,
                               barrier_s=0.0, samples_lost=lost)

    async def set_sharing(self, enabled: bool) -> None:
        pass

    async def mean_cores(self) -> float:
        return 1.0

    async def save(self, out_dir: str) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)

    async def save_policy(self, out_dir: str) -> None:
        Path(out_dir).mkdir(parents=True)

    async def save_checkpoint(self, out_dir: str) -> None:
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "steps.json").write_text(json.dumps(self.steps))

    async def usage(self) -> UsageReading:
        return UsageReading(wall=0.0, cpu_s=0.0)

    async def spans(self) -> list[Span]:
        return []


class Published(msgspec.Struct, frozen=True, kw_only=True):
    version: int


class FakeWeights:
    def __init__(self, rollout: dict[int, FakeRollout]) -> None:
        self.rollout = rollout
        self.delivered: list[int] = []

    async def publish(self, version: int) -> Published:
        return Published(version=version)

    async def deliver(self, published: Published, ranks: Sequence[int]
                      ) -> tuple[list[BroadcastTiming], list[int]]:
        await anyio.sleep(0.002)
        for rank in ranks:
            self.rollout[rank].version_now = published.version
        self.delivered.append(published.version)
        return [BroadcastTiming(version=published.version, rollout_rank=r, publish_s=0.0,
                                transfer_s=0.0, pause_s=0.0, load_s=0.0) for r in ranks], []


def config(tmp_path: Path, *, steps: int = 6, max_staleness: int = 1, groups: int = 4,
           shards: int = 1, wait_for_expiring: bool = True) -> Config:
    return msgspec.convert({
        "model": {"path": "unused"},
        "task": {"eval_size": 4},
        "rollout": {"max_inflight_prompts": 4, "group_size": 4},
        "queue": {"wait_for_expiring": wait_for_expiring},
        "staleness": {"max_staleness": max_staleness},
        "trainer": {"groups_per_step": groups, "num_shards": shards},
        "run": {"num_steps": steps, "output_dir": str(tmp_path), "progress": False,
                "eval_every": 2},
    }, Config)


def run(cfg: Config, rollout: dict[int, FakeRollout], trainers: list[FakeTrainer],
        *, weights: FakeWeights | None = None, stop_after: int = 0,
        resume: bool = False, restart: Callable[[int], FakeRollout] | None = None
        ) -> RunSummary:
    """One run on fresh fakes; ``stop_after``: request a clean stop once that many
    steps have trained; ``resume``: continue the run directory's newest checkpoint."""
    task = ArithmeticTask(seed=0)
    async def restart_rollout(rank: int, model_dir: str, version: int) -> FakeRollout:
        assert restart is not None and Path(model_dir).is_dir()  # the trainer saved it
        fresh = restart(rank)
        fresh.version_now = version
        rollout[rank] = fresh  # weight deliveries reach it from now on
        return fresh

    workers = Workers(rollout=dict(rollout), trainers=list(trainers),
                      weights=weights or FakeWeights(rollout),
                      restart_rollout=restart_rollout if restart else None)
    state = latest_checkpoint(Path(cfg.run.output_dir))[1] if resume else None
    out = RunWriter(cfg.run.output_dir, cfg, positions=state.files if state else None)
    orchestrator = Orchestrator(cfg, out, task, task.eval_prompts(cfg.task.eval_size),
                                workers)
    if state is not None:
        orchestrator.restore(state)
        for fake in rollout.values():
            fake.version_now = state.version  # engines start from the checkpoint
    if stop_after:
        train = trainers[0].train

        async def train_then_stop(batch: ShardBatch) -> ShardStepResult:
            result = await train(batch)
            if batch.step == stop_after:
                orchestrator.request_stop("SIGINT")
            return result

        trainers[0].train = train_then_stop  # type: ignore[method-assign]

    async def main() -> RunSummary:
        with anyio.fail_after(20):
            return await orchestrator.run()

    return anyio.run(main)


def ledger(path: Path) -> dict[str, list[dict[str, object]]]:
    events: dict[str, list[dict[str, object]]] = defaultdict(list)
    for line in (path / "ledger.jsonl").read_text().splitlines():
        entry = json.loads(line)
        events[str(entry["prompt_id"])].append(entry)
    return events


def trained_once_or_unfinished(events: dict[str, list[dict[str, object]]]) -> Counter[str]:
    """Every prompt's last event is trained or unfinished, and none is trained twice."""
    assert events
    for prompt_id, history in events.items():
        kinds = [e["event"] for e in history]
        assert kinds.count("trained") <= 1, prompt_id
        assert kinds[-1] in ("trained", "unfinished"), (prompt_id, kinds)
    return Counter(str(e["event"]) for h in events.values() for e in h)


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
    summary = run(cfg, {0: FakeRollout(0, slow=SLOW)}, [FakeTrainer(0)])
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
    summary = run(cfg, {0: FakeRollout(0, slow=SLOW)}, [FakeTrainer(0)])
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
    # Slots not spent on trained groups come back: the resumed gate admits the rest.
    _, saved = latest_checkpoint(tmp_path)
    assert saved.gate.started == first.groups_trained == 3 * cfg.trainer.groups_per_step

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
    # At η = 2 prompts were in flight at the stop: issued again, with the reason.
    resumed = [p for p, h in events.items() if any(e["reason"] == "resume" for e in h)]
    assert resumed
    assert all(events[p][-1]["event"] in ("trained", "unfinished") for p in resumed)
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
