"""The controller: the one place that starts Ray, creates the workers and runs the loops.

Owns: the order of a run, read top to bottom in ``Controller.run``: start workers,
evaluate the base policy, then two loops side by side —

- ``rollout_loop``: prompt source -> AdmissionGate -> a rollout worker -> ReplayQueue;
- ``training_loop``: ReplayQueue -> plan -> trainer shards -> new version -> broadcast;

with the evaluations due every ``run.eval_every`` steps running beside them
(``evaluation_loop``), then evaluate again and save. It also keeps the prompt ledger:
every admitted prompt ends trained exactly once, or dropped/failed and re-queued with a
reason. Knows nothing about how engines generate or how shards compute (workers/), nor
the rules of the gate, queue and plan (buffers/), nor when evaluations fall due and what
they are charged against (async_rl/evaluation.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from typing import Any

import anyio
import msgspec
import ray

from async_rl.auto_layout import AutoLayout
from async_rl.batching import shard_batches
from async_rl.config import Config
from async_rl.evaluation import EvalLog, describe
from async_rl.idle import ROLLOUT_TRACK, TRAINER_TRACK
from async_rl.launch import build_task, launch_workers
from async_rl.progress import RunProgress
from async_rl.records import BroadcastTiming, Group, LedgerEntry, Prompt, ShardStepResult
from async_rl.run_dir import FINAL_MODEL, WORKERS_LOG, EvalPoint, RunSummary, RunWriter
from async_rl.spans import Span, SpanRecorder
from async_rl.step_metrics import StepTotals, step_row
from async_rl.worker_logs import ray_options
from buffers.queue_records import Dropped
from buffers.replay_queue import ReplayQueue
from buffers.staleness import AdmissionGate
from workers.placement import WorkerIdentity, registry_table
from workers.rollout import RolloutWorkerError
from workers.usage import UsageReading
from workers.weights import Published, WeightBroadcast

NAMESPACE = "async-rl"
"""Ray namespace of a run's named actors ("rollout-0", "trainer-1", ...)."""


class Controller:
    """Runs one async GRPO job on a started Ray cluster."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.out = RunWriter(config.run.output_dir, config)
        self.source, self.reward_fn, self.eval_prompts = build_task(config)
        self.gate = AdmissionGate(
            groups_per_step=config.trainer.groups_per_step,
            max_staleness=config.staleness.max_staleness,
        )
        self.queue: ReplayQueue[Group] = ReplayQueue(
            max_groups=config.queue.max_groups,
            max_tokens=config.queue.max_tokens,
            bucket_edges=config.queue.bucket_edges,
            max_staleness=config.staleness.max_staleness,
            # Called the moment a group goes stale, even while a take waits: the slot must
            # come back at once or the gate could stay shut while training waits.
            on_drop=self._on_drop,
        )
        self.version = 0
        self.requeued: deque[Prompt] = deque()
        self.open_prompts: dict[str, Prompt] = {}
        """Admitted and not yet trained or re-queued: in flight or in the queue."""
        self.totals = StepTotals()
        self.evals = EvalLog(every=config.run.eval_every, num_steps=config.run.num_steps)
        self.timings: list[BroadcastTiming] = []
        """Broadcast timings completed since the last metrics row."""
        self.rollout: dict[int, Any] = {}
        self.trainers: list[Any] = []
        self.identities: list[WorkerIdentity] = []
        self.board_path = ""
        self.auto_layout: AutoLayout | None = None
        """run.layout auto's probe, until it has picked (started with the workers)."""
        record = config.run.record_spans
        # The controller's own tracks: what it waits on explains the workers' idle time.
        self.admission = SpanRecorder(worker=ROLLOUT_TRACK, role="controller", rank=0,
                                      device="driver", cause="no_work", enabled=record)
        self.training = SpanRecorder(worker=TRAINER_TRACK, role="controller", rank=0,
                                     device="driver", cause="no_work", enabled=record)

    # ---- setup -------------------------------------------------------------------------

    async def start_workers(self) -> None:
        started = await launch_workers(self.config, self.reward_fn)
        self.rollout, self.trainers = started.rollout, started.trainers
        self.identities, self.board_path = started.identities, started.board_path
        print(registry_table(self.identities))
        if self.board_path and self.config.run.layout == "shared":
            await asyncio.gather(*(t.set_sharing.remote(True) for t in self.trainers))
        if self.config.run.layout == "auto":
            self.auto_layout = AutoLayout(self.rollout, self.trainers,
                                          can_share=bool(self.board_path))
        self.broadcast = WeightBroadcast(self.trainers[0], self.rollout)

    # ---- the run, top to bottom --------------------------------------------------------

    async def run(self) -> RunSummary:
        await self.start_workers()
        start = await self.evaluate(step=0)
        started = time.perf_counter()
        self.evals.start(started)
        # Idle accounting covers the training window only: drop setup and evaluation.
        self.admission.flush()
        self.training.flush()
        usage_first = await self.read_usage()
        async with anyio.create_task_group() as evaluations:
            # Evaluations due during training run beside it; it never waits for them.
            evaluations.start_soon(self.evaluation_loop)
            with RunProgress(self.config.run.num_steps, enabled=self.config.run.progress) as bar:
                async with anyio.create_task_group() as loops:
                    loops.start_soon(self.rollout_loop)
                    await self.training_loop(bar)
                    loops.cancel_scope.cancel()
            wall_s = time.perf_counter() - started
            self.evals.training_ended()
            rollout_versions = await asyncio.gather(*(w.version.remote()
                                                      for w in self.rollout.values()))
            for prompt in self.open_prompts.values():  # generated or queued, never trained
                self._ledger(prompt, "unfinished", reason="run_ended")
            self.admission.switch("no_work")
            self.training.switch("no_work")
            usage_last = await self.read_usage()
            await self.write_spans()
            # A sharing trainer used a varying number of cores: the CPU-time check
            # divides by its thread count averaged over compute.
            trainer_cores = await asyncio.gather(*(t.mean_cores.remote()
                                                   for t in self.trainers))
            cores: dict[str, float] = {i.name: float(len(i.devices)) for i in self.identities}
            cores.update({f"trainer-{r}": c for r, c in enumerate(trainer_cores)})
            self.out.usage({name: {"first": usage_first[name], "last": reading,
                                   "cores": cores[name]}
                            for name, reading in usage_last.items() if name in usage_first})
        # Any evaluation still due has finished (after the training window was recorded).
        end = await self.evaluate(step=self.config.run.num_steps)
        await asyncio.to_thread(
            ray.get, self.trainers[0].save.remote(str(self.out.path / FINAL_MODEL))
        )
        summary = self.totals.summary(
            wall_s=wall_s, final_version=self.version,
            accuracy_start=start.accuracy if start else None,
            accuracy_end=end.accuracy if end else None,
            max_staleness=self.config.staleness.max_staleness,
            rollout_version=min(rollout_versions, default=-1),
            evals=self.evals.points, target_accuracy=self.config.run.target_accuracy,
        )
        self.out.summary(summary)
        self.out.close()
        return summary

    async def rollout_loop(self) -> None:
        """Admits prompts through the gate and hands each to the least-busy live worker."""
        busy = {rank: 0 for rank in self.rollout}
        free = anyio.Condition()
        limit = self.config.rollout.max_inflight_prompts
        async with anyio.create_task_group() as generations:
            while True:
                if not self.gate.open_slots:
                    self.admission.switch("gate_closed", self.gate.version)
                await self.gate.acquire()
                async with free:
                    while not self.rollout or min(busy[r] for r in self.rollout) >= limit:
                        # Slots held by groups blocked on a full queue are backpressure.
                        full = self.queue.statistics().put_waits.waiting_now > 0
                        self.admission.switch("queue_full" if full else "admitting")
                        await free.wait()
                    rank = min(self.rollout, key=lambda r: busy[r])
                    busy[rank] += 1
                self.admission.switch("admitting", self.gate.version)
                prompt = self.requeued.popleft() if self.requeued else self.source.next_prompt()
                self._ledger(prompt, "admitted")
                self.open_prompts[prompt.prompt_id] = prompt
                generations.start_soon(self.generate, rank, prompt, busy, free)

    async def generate(
        self, rank: int, prompt: Prompt, busy: dict[int, int], free: anyio.Condition
    ) -> None:
        """One prompt on one worker, then into the queue (waiting there is backpressure)."""
        try:
            group: Group = await self.rollout[rank].generate_group.remote(prompt)
            self.totals.reward_failures += sum(s.reward_failed for s in group.samples)
            self._ledger(prompt, "generated")
            # The worker's slot stays taken until the queue has room: backpressure.
            await self.queue.put(group)
        except ray.exceptions.RayError as err:
            self.totals.rollout_failures += 1
            broken = isinstance(getattr(err, "cause", None), RolloutWorkerError)
            if broken or isinstance(err, ray.exceptions.RayActorError):
                self._retire(rank, f"{type(err).__name__}")  # dead or broken: no more prompts
            self._requeue(prompt, "failed", f"rollout_error:{type(err).__name__}")
        finally:
            async with free:
                busy[rank] -= 1
                free.notify_all()

    async def training_loop(self, bar: RunProgress) -> None:
        """Take a step's groups, plan, train on every shard, publish the new version.

        Delivery of a published version to the rollout workers runs beside the next
        step; the gate opens for a version only once every worker runs it.
        """
        cfg = self.config
        delivered = anyio.Event()
        delivered.set()
        async with anyio.create_task_group() as deliveries:
            for step in range(1, cfg.run.num_steps + 1):
                self.training.switch("wait_data", self.version)
                t0 = time.perf_counter()
                groups = await self.queue.take(cfg.trainer.groups_per_step,
                                               at_version=self.version,
                                               homogeneous=cfg.queue.homogeneous_take)
                self.training.switch("training")
                t1 = time.perf_counter()
                batches, plan = shard_batches(groups, cfg.trainer.num_shards, cfg.trainer, step)
                results: list[ShardStepResult] = await asyncio.gather(
                    *(shard.train_step.remote(b)
                      for shard, b in zip(self.trainers, batches, strict=True))
                )
                t2 = time.perf_counter()
                staleness = [self.version - g.min_version for g in groups]
                self.version += 1
                for group in groups:
                    self.open_prompts.pop(group.prompt_id, None)
                    self._ledger(group.prompt, "trained", version=self.version - 1)
                if self.version % cfg.weights.sync_every == 0:
                    self.training.switch("weight_publish", self.version)
                    published = await self.broadcast.publish(self.version)
                    previous, delivered = delivered, anyio.Event()
                    deliveries.start_soon(self.deliver, published, previous, delivered)
                timings, self.timings = self.timings, []
                row = step_row(
                    step=step, version=self.version, groups=groups, results=results,
                    plan=plan, staleness=staleness, wait_s=t1 - t0, train_s=t2 - t1,
                    sync_s=time.perf_counter() - t2, timings=timings,
                    queue=self.queue.statistics(), totals=self.totals,
                )
                self.out.metrics(row)
                self.evals.produced(self.version, t2, samples=self.totals.samples_trained,
                                    groups=self.totals.groups_trained,
                                    tokens=self.totals.tokens_trained)
                bar.update(row)
                if self.auto_layout is not None and not self.auto_layout.choice:
                    await self.auto_layout.after_step(step, results)
            self.training.switch("weight_publish")  # the last delivery, awaited on exit

    async def deliver(self, published: Published, previous: anyio.Event,
                      done: anyio.Event) -> None:
        """Loads a published version into every rollout worker, in version order."""
        await previous.wait()
        timings, failed = await self.broadcast.deliver(published)
        self.timings.extend(timings)
        for rank in failed:
            self._retire(rank, f"weight load of version {published.version} failed")
        self.gate.on_version(published.version)
        done.set()
        # Evaluated once delivered, so the engine already runs (at least) this version.
        self.evals.delivered(published.version)

    async def evaluation_loop(self) -> None:
        """Runs the evaluations due during training one at a time, until training ends."""
        async with self.evals.due_steps:
            async for step in self.evals.due_steps:
                try:
                    await self.evaluate(step)
                except ray.exceptions.RayError as err:
                    # Costs this row only; generation notices a broken worker and retires it.
                    print(f"eval at step {step} failed: {type(err).__name__}")

    async def evaluate(self, step: int) -> EvalPoint | None:
        """Greedy held-out accuracy on a rollout worker's engine; one row of eval.jsonl."""
        if not self.eval_prompts or not self.rollout:
            return None
        worker = self.rollout[min(self.rollout)]
        point = self.evals.record(step, await worker.evaluate.remote(list(self.eval_prompts)))
        self.out.eval(point)
        print(describe(point))
        return point

    async def read_usage(self) -> dict[str, UsageReading]:
        """Each live worker's CPU-time (and NVML) counters, keyed by worker name."""
        actors = [(f"rollout-{r}", a) for r, a in self.rollout.items()]
        actors += [(f"trainer-{r}", a) for r, a in enumerate(self.trainers)]
        readings = await asyncio.gather(*(a.usage.remote() for _, a in actors))
        return {name: reading for (name, _), reading in zip(actors, readings, strict=True)}

    async def write_spans(self) -> None:
        """Gathers every worker's spans, shifts them onto the driver's clock, stores them."""
        if not self.config.run.record_spans:
            return
        spans = self.admission.flush() + self.training.flush()
        for actor in [*self.rollout.values(), *self.trainers]:
            sent = time.time()
            remote_now: float = await actor.clock.remote()
            offset = remote_now - (sent + time.time()) / 2  # remote clock minus ours
            worker_spans: list[Span] = await actor.drain_spans.remote()
            spans += [
                msgspec.structs.replace(sp, start=sp.start - offset, end=sp.end - offset)
                for sp in worker_spans
            ]
        self.out.spans(spans)

    # ---- the ledger ----------------------------------------------------------------------

    def _ledger(self, prompt: Prompt, event: str, *, reason: str = "",
                version: int | None = None) -> None:
        self.out.ledger(
            LedgerEntry(
                prompt_id=prompt.prompt_id, event=event,
                version=self.version if version is None else version,
                attempt=prompt.attempt, reason=reason, time=time.time(),
            )
        )

    def _retire(self, rank: int, why: str) -> None:
        """Stops using a dead or broken rollout worker; the run goes on with the others."""
        if self.rollout.pop(rank, None) is not None:
            print(f"rollout-{rank} retired: {why}")
            self.totals.retired_workers += 1
        if not self.rollout:
            raise RuntimeError(f"every rollout worker is gone (last: rollout-{rank}: {why})")

    def _on_drop(self, dropped: Dropped[Group]) -> None:
        self.totals.dropped_stale += 1
        self._requeue(dropped.item.prompt, "dropped", dropped.reason)

    def _requeue(self, prompt: Prompt, event: str, reason: str) -> None:
        """Gives the prompt's admission slot back and runs it again: nothing is lost."""
        self._ledger(prompt, event, reason=reason)
        self.open_prompts.pop(prompt.prompt_id, None)
        self.gate.release()
        self.requeued.append(msgspec.structs.replace(prompt, attempt=prompt.attempt + 1))
        self._ledger(prompt, "requeued", reason=reason)

    async def shutdown(self) -> None:
        for worker in self.rollout.values():
            with contextlib.suppress(ray.exceptions.RayError):
                await worker.shutdown.remote()
        if self.board_path:
            with contextlib.suppress(OSError):
                os.unlink(self.board_path)


def run_training(config: Config, *, verbose: bool = False) -> RunSummary:
    """Starts (or joins) Ray, runs the job, and always shuts Ray down if it started it.

    Workers' output goes to RUN_DIR/workers.log, only their warnings and errors to the
    console, unless ``verbose``."""
    started_ray = not ray.is_initialized()
    if started_ray:
        needed = (config.rollout.num_workers * config.rollout.cpus_per_worker
                  + config.trainer.num_shards * config.trainer.cpus_per_shard)
        console = ray_options(os.path.join(config.run.output_dir, WORKERS_LOG), verbose)
        if config.run.ray_address:
            ray.init(address=config.run.ray_address, namespace=NAMESPACE, **console)
        else:
            # address="local": a new cluster even when `ray start` left one running.
            ray.init(address="local", num_cpus=max(config.run.num_cpus, needed),
                     include_dashboard=False, _node_ip_address="127.0.0.1",
                     namespace=NAMESPACE, **console)
    controller = Controller(config)

    async def main() -> RunSummary:
        try:
            return await controller.run()
        finally:
            await controller.shutdown()

    try:
        return anyio.run(main)
    finally:
        if started_ray:
            ray.shutdown()
