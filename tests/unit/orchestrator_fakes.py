"""In-process fake workers for the orchestrator's unit tests (no Ray), and running it.

The fakes implement ``async_rl.control.protocols`` the simplest way that keeps the contracts a
real worker keeps: a rollout fake labels its tokens with the version it runs and sleeps
to make groups finish out of order; a trainer fake resolves its batch's in-process
tokens; the weight fake delivers a version by setting it on every live rollout fake.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import anyio
import msgspec

from async_rl.config import Config
from async_rl.control.checkpoint_files import latest_checkpoint
from async_rl.control.failures import EvaluationFailed, RolloutFailed
from async_rl.control.orchestrator import Orchestrator
from async_rl.control.protocols import OwnRoles, PolicyWeights, RoleStagesClient, Workers
from async_rl.run.run_dir import RunWriter
from async_rl.run.summary import RunSummary
from async_rl.sim.clock import run_virtual, virtual_now
from async_rl.tasks.sources import ArithmeticTask
from buffers.common.records import Group, GroupTokens, Prompt, Sample, make_group
from buffers.common.reports import BroadcastTiming, EvalResult, UsageReading
from buffers.common.train_records import LossStats, ShardBatch, ShardStepResult
from workers.common.spans import Span

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

    async def usage(self) -> UsageReading:
        return UsageReading(wall=0.0, cpu_s=0.0)

    async def spans(self) -> list[Span]:
        return []


class InProcessTokens:
    """Tokens kept in the groups themselves (what the fakes do): a group's ``GroupTokens``
    are its own reference; anything else (``LOST``) cannot be had."""

    def __init__(self) -> None:
        self.put_back = 0
        """Groups whose tokens a resume put back."""

    async def fetch(self, refs: Sequence[object]) -> list[GroupTokens | None]:
        return [ref if isinstance(ref, GroupTokens) else None for ref in refs]

    def put(self, tokens: GroupTokens) -> GroupTokens:
        self.put_back += 1
        return tokens


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

    async def mean_cores(self) -> float:
        return 1.0

    async def policy_weights(self, version: int) -> FakePolicyWeights:
        return FakePolicyWeights(version=version, steps_trained=tuple(self.steps))

    async def save(self, out_dir: str) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)

    async def save_policy(self, out_dir: str) -> None:
        Path(out_dir).mkdir(parents=True)

    async def save_checkpoint(self, out_dir: str) -> None:
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "steps.json").write_text(json.dumps(self.steps))

    async def checkpoint_written(self) -> None:
        pass

    async def usage(self) -> UsageReading:
        return UsageReading(wall=0.0, cpu_s=0.0)

    async def spans(self) -> list[Span]:
        return []


class FakePolicyWeights(msgspec.Struct, frozen=True, kw_only=True):
    """What a fake shard's weights hold: the steps it had trained when they were taken."""

    version: int
    steps_trained: tuple[int, ...]


class FakeEvaluator:
    """Scores whatever weights it gets; fails the evaluation of the versions in ``fails``."""

    def __init__(self, fails: frozenset[int] = frozenset()) -> None:
        self.fails = fails
        self.scored: list[FakePolicyWeights] = []

    async def evaluate(self, prompts: Sequence[Prompt], weights: PolicyWeights) -> EvalResult:
        assert isinstance(weights, FakePolicyWeights)
        await anyio.sleep(0.01)  # training goes on meanwhile
        if weights.version in self.fails:
            raise EvaluationFailed("the evaluator died")
        self.scored.append(weights)
        return EvalResult(accuracy=0.5, version_min=weights.version,
                          version_max=weights.version, num_prompts=len(prompts),
                          rollout_rank=-1, seconds=0.01)


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
        "task": {"kind": "arithmetic", "eval_size": 4},
        "rollout": {"max_inflight_prompts": 4, "group_size": 4},
        "queue": {"wait_for_expiring": wait_for_expiring},
        "staleness": {"max_staleness": max_staleness},
        "trainer": {"groups_per_step": groups, "num_shards": shards},
        "run": {"num_steps": steps, "output_dir": str(tmp_path), "progress": False,
                "eval_every": 2},
    }, Config)


def run(cfg: Config, rollout: dict[int, FakeRollout], trainers: list[FakeTrainer],
        *, weights: FakeWeights | None = None, evaluator: FakeEvaluator | None = None,
        stop_after: int = 0,
        resume: bool = False, restart: Callable[[int], FakeRollout] | None = None,
        virtual: bool = False,
        beside: Callable[[Orchestrator], Awaitable[None]] | None = None,
        stages: Sequence[RoleStagesClient] = (), own: OwnRoles | None = None,
        tokens: InProcessTokens | None = None) -> RunSummary:
    """One run on fresh fakes; ``stop_after``: request a clean stop once that many
    steps have trained; ``resume``: continue the run directory's newest checkpoint;
    ``virtual``: on the simulator's virtual clock, so that the fakes' sleeps order the
    run the same way however loaded the machine is (a test that needs groups to finish
    out of order by a margin); ``beside``: runs beside the orchestrator (a signal
    arriving mid-run, say); ``stages``: the PPO dataflow's stages, one per shard;
    ``own``: the roles on workers of their own; ``tokens``: where the groups' tokens are
    fetched from and put back (default: a new ``InProcessTokens``)."""
    task = ArithmeticTask(seed=0)
    async def restart_rollout(rank: int, model_dir: str, version: int) -> FakeRollout:
        assert restart is not None and Path(model_dir).is_dir()  # the trainer saved it
        fresh = restart(rank)
        fresh.version_now = version
        rollout[rank] = fresh  # weight deliveries reach it from now on
        return fresh

    workers = Workers(rollout=dict(rollout), trainers=list(trainers),
                      weights=weights or FakeWeights(rollout), evaluator=evaluator,
                      restart_rollout=restart_rollout if restart else None,
                      stages=list(stages), own=own or OwnRoles(),
                      tokens=tokens or InProcessTokens())
    state = latest_checkpoint(Path(cfg.run.output_dir))[1] if resume else None
    out = RunWriter(cfg.run.output_dir, cfg, positions=state.files if state else None)
    def build() -> Orchestrator:
        # In the running loop: a virtual clock reads it from the start.
        orchestrator = Orchestrator(cfg, out, task, task.eval_prompts(cfg.task.eval_size),
                                    workers, clock=virtual_now if virtual else None)
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
        return orchestrator

    async def main() -> RunSummary:
        orchestrator = build()
        with anyio.fail_after(20):
            if beside is None:
                return await orchestrator.run()
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(beside, orchestrator)
                summary = await orchestrator.run()
                tasks.cancel_scope.cancel()
            return summary

    return run_virtual(main) if virtual else anyio.run(main)


def ledger(path: Path) -> dict[str, list[dict[str, object]]]:
    events: dict[str, list[dict[str, object]]] = defaultdict(list)
    for line in (path / "ledger.jsonl").read_text().splitlines():
        entry = json.loads(line)
        events[str(entry["prompt_id"])].append(entry)
    return events


def restored_and_trained(events: dict[str, list[dict[str, object]]]) -> set[str]:
    """The prompts whose queued group a resume restored from its checkpoint; each was
    trained once after it without a new generation (unless first dropped as stale, and
    then generated anew)."""
    restored = set()
    for prompt_id, history in events.items():
        kinds = [str(e["event"]) for e in history]
        if "restored" not in kinds:
            continue
        restored.add(prompt_id)
        after = kinds[kinds.index("restored") + 1:]
        assert kinds.count("restored") == 1 and after.count("trained") <= 1, (prompt_id, kinds)
        stale = [e for e in history[kinds.index("restored") + 1:]
                 if (e["event"], e["reason"]) == ("dropped", "stale")]
        if not stale:
            assert "generated" not in after and after[-1:] in (["trained"], ["unfinished"]), (
                prompt_id, kinds)
    return restored


def trained_once_or_unfinished(events: dict[str, list[dict[str, object]]]) -> Counter[str]:
    """Every prompt's last event is trained, unfinished or a final drop (as filtered,
    rollout.filter_groups, or past run.max_readmissions), and none is trained twice."""
    assert events
    for prompt_id, history in events.items():
        kinds = [e["event"] for e in history]
        assert kinds.count("trained") <= 1, prompt_id
        last = history[-1]
        assert (last["event"] in ("trained", "unfinished")
                or (last["event"], last["reason"]) in (("dropped", "filtered"),
                                                       ("dropped", "readmissions_exhausted"))
                ), (prompt_id, kinds)
    return Counter(str(e["event"]) for h in events.values() for e in h)
