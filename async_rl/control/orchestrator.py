"""The orchestrator: one async GRPO run's logic, in plain Python (no Ray).

Owns: the order of a run, read top to bottom in ``Orchestrator.run``: evaluate the base
policy, then two loops side by side —

- the rollout side (``async_rl.control.rollout_admission``): prompt source ->
  AdmissionGate -> a rollout worker -> ReplayQueue;
- ``training_loop``: ReplayQueue -> plan -> trainer shards -> new version -> weights;

with the evaluations due every ``run.eval_every`` steps beside them
(``async_rl.control.evaluation_runner``), then save and evaluate again. Picking and
replacing rollout workers is ``async_rl.control.rollout_pool``'s; which failures stop the
run, ``async_rl.control.run_health``'s; what a checkpoint holds and the order of its
writes, ``async_rl.control.checkpoint_parts``'; reading the workers' usage and spans,
``async_rl.control.worker_readings``'. It keeps the prompt ledger: every admitted prompt
ends trained exactly once, dropped as filtered (rollout.filter_groups), re-queued with
a reason (a failure, a stale drop, a group left with fewer than two members, an
environment timeout or error with on_timeout / on_error = "requeue"), or, past
run.max_readmissions re-admissions, dropped for good. A group's members are the samples
the policy wrote and the task scored (``Group.members``); the rest are counted by reason.
It sees workers only through ``async_rl.control.protocols`` and groups only as metadata
(the tokens stay with the workers). Knows nothing about Ray (``async_rl.shell.ray_shell``
starts the workers and hands them in), how engines generate or shards compute, nor the
rules of the gate, queue and plan (buffers/).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence

import anyio
import anyio.abc

from async_rl.analysis.idle import ROLLOUT_TRACK, TRAINER_TRACK
from async_rl.config import Config
from async_rl.control.checkpoint_files import RunState
from async_rl.control.checkpoint_parts import RunCheckpoints
from async_rl.control.evaluation import EvalLog
from async_rl.control.evaluation_runner import EvaluationRunner
from async_rl.control.loss_stats import role_metrics
from async_rl.control.prompt_ledger import PromptLedger
from async_rl.control.protocols import (
    PublishedWeights,
    RunFailed,
    Workers,
    first_error,
)
from async_rl.control.role_stages import RoleStages
from async_rl.control.rollout_admission import RolloutAdmission
from async_rl.control.rollout_pool import RolloutPool
from async_rl.control.run_health import RunHealth
from async_rl.control.step_metrics import StepTotals, step_row
from async_rl.control.worker_readings import WorkerReadings
from async_rl.run.progress import RunProgress
from async_rl.run.run_dir import FINAL_MODEL, RunWriter
from async_rl.run.summary import EvalPoint, RunSummary
from async_rl.tasks.sources import PromptSource
from buffers.common.concurrent_calls import each
from buffers.common.records import Group, Prompt, ShardStepResult
from buffers.common.reports import BroadcastTiming, CriticStepResult
from buffers.plan.batching import shard_batches
from buffers.queue.replay_queue import ReplayQueue
from buffers.queue.staleness import AdmissionGate
from workers.common.spans import SpanRecorder

log = logging.getLogger(__name__)

CRITIC_WARMUP = "critic_warmup"
"""The ledger's reason for a prompt run again after a critic.warmup_steps step."""


class Orchestrator:
    """Runs one async GRPO job on started workers; see the module docstring."""

    def __init__(self, config: Config, out: RunWriter, source: PromptSource,
                 eval_prompts: Sequence[Prompt], workers: Workers,
                 clock: Callable[[], float] | None = None) -> None:
        """``clock``: the one time source of the run (durations, spans, the ledger, the
        queue's and gate's waits); None: the system's (``time.perf_counter`` for
        durations, ``time.time`` for spans and the ledger). ``async-rl simulate`` passes
        its virtual clock, which its event loop's timers also run on."""
        self.config, self.out, self.source = config, out, source
        self.clock = clock or time.perf_counter
        wall = clock or time.time
        self.trainers, self.weights = workers.trainers, workers.weights
        self.stages = (RoleStages(workers.stages, warmup_steps=config.critic.warmup_steps
                                  if config.has_critic else 0, own=workers.own)
                       if workers.stages else None)
        """The reference's and the critic's stages on the trainer shards (PPO's dataflow);
        None: GRPO's."""
        self.version = 0
        self.first_step = 1
        """The step this run starts at (after a checkpoint's, on resume)."""
        self.wall_offset = 0.0
        """Training wall time already spent before this process (on resume)."""
        self.stop_reason = ""
        """Set by ``request_stop``: no step starts after it; the run ends cleanly."""
        self.stop_deadline = math.inf
        """When a requested stop gives up waiting for the step's groups (event-loop
        time: run.stop_timeout_s after ``request_stop``)."""
        self._taking: anyio.CancelScope | None = None
        """The wait for a step's groups, while it runs (a stop's deadline reaches it)."""
        self.step_lock = anyio.Lock()
        """Held while shards train and the version moves on: holding it, the trainer's
        weights are exactly ``self.version`` (a restarted engine starts from them)."""
        self.timings: list[BroadcastTiming] = []
        """Broadcast timings completed since the last metrics row."""

        # The run's own bookkeeping, each part built from the config sections it reads.
        self.totals = StepTotals(bucket_edges=config.queue.bucket_edges)
        self.pool = RolloutPool.from_config(config.rollout, workers, totals=self.totals,
                                            current_policy=self.current_policy,
                                            call_timeout_s=config.run.call_timeout_s)
        self.health = RunHealth.from_config(config.trainer, config.rollout, self.totals,
                                            clock=self.clock)
        self.prompts = PromptLedger.from_config(config.run, out, lambda: self.version,
                                                clock=wall)
        self.evals = EvalLog.from_config(config.run)
        self.evaluations = EvaluationRunner(eval_prompts, self.evals, self.pool,
                                            self.health, out, evaluator=workers.evaluator,
                                            source=self.trainers[0])
        self.readings = WorkerReadings(self.pool, self.trainers, self.health,
                                       roles=workers.own.workers)
        # The orchestrator's own tracks: what it waits on explains the workers' idle time.
        self.admission, self.training = (
            SpanRecorder(worker=track, role="controller", rank=0, device="driver",
                         cause="no_work", enabled=config.run.record_spans, clock=wall)
            for track in (ROLLOUT_TRACK, TRAINER_TRACK))

        # The data path (buffers/): the gate in front of the workers, the queue behind.
        self.gate = AdmissionGate.from_config(
            config.staleness, groups_per_step=config.trainer.groups_per_step,
            clock=self.clock)
        # on_drop is called the moment a group goes stale, even while a take waits: the
        # slot must come back at once or the gate could stay shut while training waits.
        self.queue: ReplayQueue[Group] = ReplayQueue.from_config(
            config.queue, config.staleness,
            on_drop=lambda dropped: self.admitting.on_drop(dropped), clock=self.clock)
        self.admitting = RolloutAdmission(
            task=config.task, rollout=config.rollout, trainer=config.trainer, source=source,
            gate=self.gate, pool=self.pool, prompts=self.prompts, totals=self.totals,
            health=self.health, span=self.admission, queue=self.queue)
        # What a checkpoint gathers from all of the above.
        self.checkpoints = RunCheckpoints.from_config(
            config.run, config.trainer, out, self.gate, source, self.totals, self.prompts,
            self.evals)

    # ---- the run, top to bottom --------------------------------------------------------

    async def run(self) -> RunSummary:
        """The whole run; worker restarts and evaluations due run beside it. A failure
        stops it with a checkpoint and a summary, as ``RunFailed`` with one line."""
        try:
            async with self.pool.replacing(), anyio.create_task_group() as background:
                summary = await self._run(background)
        except BaseExceptionGroup as group:
            failure = first_error(group)
            if failure is None and (error := first_error(group, (Exception,))) is not None:
                failure = self.health.unexpected(error, self.out.path)
            if failure is None:
                raise
            with anyio.CancelScope(shield=True):
                message = await self._stop_failed(failure, group)
            raise RunFailed(message) from None
        return summary

    async def _run(self, background: anyio.abc.TaskGroup) -> RunSummary:
        start = (await self.evaluations.evaluate(step=0, version=self.version)
                 if self.first_step == 1 else None)
        started = self.clock() - self.wall_offset
        self.evals.start(started)
        # Idle accounting covers the training window only: the workers' usage from here,
        # and each loop's track from its start (setup and evaluation dropped).
        usage_first = await self.readings.usage()
        background.start_soon(self.evaluations.due_loop)
        background.start_soon(self.health.stall_watch, lambda: len(self.pool))
        with RunProgress(self.config.run.num_steps, enabled=self.config.run.progress) as bar:
            async with anyio.create_task_group() as loops:
                loops.start_soon(self.admitting.loop)
                await self.training_loop(bar)
                loops.cancel_scope.cancel()
        self.health.watching = False
        wall_s = self.clock() - started
        self.evals.training_ended()
        rollout_versions = await self.readings.rollout_versions()
        self.prompts.close()
        self.admission.switch("no_work")
        self.training.switch("no_work")
        self.out.usage(await self.readings.usage_since(usage_first))
        if self.config.run.record_spans:
            self.out.spans(self.admission.flush() + self.training.flush()
                           + await self.readings.spans())
        # Evaluations still due finish (after the training window was recorded).
        await self.evaluations.over.wait()
        await self.checkpoints.save(self.version, wall_s, self.trainers[0])
        await self.trainers[0].save(str(self.out.path / FINAL_MODEL))
        end = (None if self.stop_reason
               else await self.evaluations.evaluate(self.version, self.version))
        if start is None and self.evals.points:
            start = self.evals.points[0]
        summary = self._summary(wall_s, start, end, rollout_versions, self.stop_reason)
        self.out.summary(summary)
        self.out.close()
        return summary

    def _summary(self, wall_s: float, start: EvalPoint | None, end: EvalPoint | None,
                 rollout_versions: Sequence[int], stopped: str) -> RunSummary:
        return self.totals.summary(
            wall_s=wall_s, final_version=self.version,
            accuracy_start=start.accuracy if start else None,
            accuracy_end=end.accuracy if end else None,
            max_staleness=self.config.staleness.max_staleness,
            rollout_version=min(rollout_versions, default=-1),
            evals=self.evals.points, target_accuracy=self.config.run.target_accuracy,
            stopped=stopped,
        )

    async def training_loop(self, bar: RunProgress) -> None:
        """Take a step's groups, plan, train on every shard, publish the new version.

        Delivery of a published version to the rollout workers runs beside the next
        step; the gate opens for a version only once every worker runs it. A step whose
        groups a shard could not fetch (their rollout worker died) trains nothing: its
        prompts run again and the step is taken anew.
        """
        cfg = self.config
        step = self.first_step
        self.training.flush()  # the track starts with the loop: setup and evaluation dropped
        # Published versions go to the rollout workers one at a time, in version order,
        # beside the next steps; leaving the block waits for the last delivery.
        to_deliver, published_versions = anyio.create_memory_object_stream[PublishedWeights](
            math.inf)
        async with anyio.create_task_group() as deliveries, to_deliver:
            deliveries.start_soon(self.delivery_loop, published_versions)
            while step <= cfg.run.num_steps and not self.stop_reason:
                self.training.switch("wait_data", self.version)
                t0 = self.clock()
                with anyio.CancelScope(deadline=self.stop_deadline) as taking:
                    self._taking = taking
                    groups = await self.queue.take(cfg.trainer.groups_per_step,
                                                   at_version=self.version,
                                                   homogeneous=cfg.queue.homogeneous_take)
                self._taking = None
                if taking.cancelled_caught:
                    break  # a stop's deadline passed before the step had its groups
                # Prompt order, not arrival order: the same groups then train in the same
                # mini-batches and sums whatever the generation's timing (a whitened step's
                # near-zero gradients would otherwise flip sign with the order under Adam).
                groups.sort(key=lambda g: (g.prompt.prompt_id, g.prompt.attempt))
                self.training.switch("training")
                t1 = self.clock()
                batches, plan = shard_batches(groups, cfg.trainer.num_shards, cfg.trainer, step,
                                              max_new_tokens=cfg.rollout.max_new_tokens)
                critic: list[CriticStepResult] = []
                results: list[ShardStepResult] = []
                async with self.step_lock:
                    stages = self.stages
                    if stages is not None:  # the PPO dataflow, in order, on every shard
                        await stages.prepare(batches)
                        await stages.reference_logprobs(step)
                        await stages.critic_values(step)
                        await stages.advantages(step)
                    # critic.warmup_steps: the critic alone trains; the policy's steps
                    # start later.
                    warming_up = stages is not None and stages.warming_up
                    if not warming_up:
                        results = await each([  # the policy's update
                            functools.partial(shard.train, batch)
                            for shard, batch in zip(self.trainers, batches, strict=True)
                        ])
                    if stages is not None:
                        critic = await stages.critic_update(step)
                    untrained = (self._critic_warm_up(critic) if warming_up
                                 else self.health.untrained_reason(step, results))
                    if not untrained:
                        self.version += 1
                self.health.progressed()
                if untrained:  # the policy did not move: the step's prompts run again
                    event = "dropped" if untrained == CRITIC_WARMUP else "failed"
                    for group in groups:
                        self.admitting.requeue(group.prompt, event, untrained)
                    continue
                t2 = self.clock()
                staleness = [self.version - 1 - g.min_version for g in groups]
                for group in groups:
                    self.prompts.trained(group, version=self.version - 1)
                if self.version % cfg.weights.sync_every == 0:
                    self.training.switch("weight_publish", self.version)
                    to_deliver.send_nowait(await self.weights.publish(self.version))
                timings, self.timings = self.timings, []
                row = step_row(
                    step=step, version=self.version, groups=groups, results=results,
                    plan=plan, staleness=staleness, wait_s=t1 - t0, train_s=t2 - t1,
                    sync_s=self.clock() - t2, timings=timings,
                    queue=self.queue.statistics(), totals=self.totals, trainer=cfg.trainer,
                ) | role_metrics(results, critic, measured_kl=cfg.has_reference)
                self.out.metrics(row)
                self.evals.produced(self.version, t2, samples=self.totals.samples_trained,
                                    groups=self.totals.groups_trained,
                                    tokens=self.totals.tokens_trained)
                await self.evaluations.version_trained(self.version)
                bar.update(row)
                every = cfg.run.checkpoint_every
                if every and step % every == 0 and step < cfg.run.num_steps:
                    # The shards snapshot in order with training; the write runs beside
                    # the next steps (deliveries' task group awaits it on exit).
                    self.training.switch("checkpoint", self.version)
                    await self.checkpoints.save(self.version,
                                                self.clock() - self.evals.started,
                                                self.trainers[0], background=deliveries)
                step += 1
            self.training.switch("checkpoint")
            await self.checkpoints.wait_written()
            self.training.switch("weight_publish")  # the last delivery, awaited on exit

    async def delivery_loop(self, published_versions: anyio.abc.ObjectReceiveStream[
            PublishedWeights]) -> None:
        """Loads each published version into every live rollout worker, in version order,
        until training ends."""
        async with published_versions:
            async for published in published_versions:
                targets = self.pool.workers
                timings, failed = await self.weights.deliver(published, list(targets))
                self.timings.extend(timings)
                for rank in failed:
                    self.pool.retire(rank, targets[rank],
                                     f"weight load of version {published.version} failed")
                self.gate.on_version(published.version)
                # On the rollout engines: evaluated once delivered, so they run it.
                self.evaluations.version_delivered(published.version)

    # ---- stopping, failing, resuming ---------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Ends the run cleanly after the step in progress: no new step starts. A step
        still waiting for its groups gets run.stop_timeout_s more; then it is abandoned
        (its groups stay owed: the checkpoint keeps their prompts). Call it in the run's
        event loop."""
        if not self.stop_reason:
            self.stop_reason = reason
            timeout = self.config.run.stop_timeout_s
            self.stop_deadline = anyio.current_time() + timeout
            if self._taking is not None:
                self._taking.deadline = self.stop_deadline
            log.info("%s: stopping after the current step, waiting at most %g s for it "
                     "(run.stop_timeout_s; again to stop at once)", reason, timeout)

    async def _stop_failed(self, failure: Exception,
                           group: BaseExceptionGroup[BaseException]) -> str:
        """After a failure: a checkpoint from a live trainer shard, a summary saying why;
        returns the one line the user gets."""
        dead = self.health.failed(failure, group)
        wall_s = self.clock() - self.evals.started
        saved = await self.checkpoints.save_after_failure(self.version, wall_s,
                                                          self.trainers, dead)
        message = self.health.message(failure, saved)
        self.out.summary(self._summary(wall_s, None, None, (), f"failed: {failure}"))
        self.out.close()
        return message

    def restore(self, state: RunState, refused: int = 0) -> None:
        """Continues from a checkpoint: its version (the workers were started from its
        weights), counters and cursor; its unfinished prompts are issued first.
        ``refused``: newer checkpoints that did not verify (restore failures)."""
        self.version = state.version
        self.first_step = state.step + 1
        self.wall_offset = state.wall_s
        if self.stages is not None:
            self.stages.warmup_left = 0  # made before the checkpoint's first step
        self.checkpoints.restore(state, refused)

    # ---- workers lost, prompts re-queued -------------------------------------------------

    async def current_policy(self, rank: int) -> tuple[str, int]:
        """The trainer's current policy, written for rollout worker ``rank`` to restart
        from, and its version (under the step lock: exactly that version)."""
        async with self.step_lock:
            model_dir = self.out.path / "restarts" / f"rollout-{rank}-v{self.version}"
            await self.trainers[0].save_policy(str(model_dir))
            return str(model_dir), self.version

    def _critic_warm_up(self, critic: Sequence[CriticStepResult]) -> str:
        """Why a critic.warmup_steps step's prompts run again (for the policy, which did
        not train on them): ``CRITIC_WARMUP`` once the critic fitted them, or
        "samples_lost" when a shard could not fetch them (the warm-up step is taken
        anew)."""
        assert self.stages is not None
        if any(c.samples_lost for c in critic):
            return "samples_lost"
        self.stages.warmup_left -= 1
        metrics = role_metrics((), critic, measured_kl=False)
        log.info("critic warm-up step (%d left): value loss %.4g",
                 self.stages.warmup_left, metrics.get("critic/value_loss", math.nan))
        return CRITIC_WARMUP
