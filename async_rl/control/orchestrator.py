"""The orchestrator: one async GRPO run's logic, in plain Python (no Ray).

Owns: the order of a run, read top to bottom in ``Orchestrator.run``: evaluate the base
policy, then two loops side by side —

- the rollout side (``async_rl.control.rollout_admission``): prompt source ->
  AdmissionGate -> a rollout worker -> ReplayQueue;
- ``training_loop``: ReplayQueue -> plan -> the step's stages on the trainer shards
  (``async_rl.control.step_stages``: GRPO's, or PPO's with the reference and the critic)
  -> new version -> weights, then, with ``[autopilot]``, the live keys retuned between
  steps (``async_rl.control.live_tuning``);

with the evaluations due every ``run.eval_every`` steps beside them
(``async_rl.control.evaluation_runner``), then save and evaluate again. It builds the
run's parts, each before the parts that use it, so that none calls back into it: the
policy's version and step lock (``async_rl.control.trainer_policy``) before the rollout
pool that restarts engines from it, the prompt book (``async_rl.control.prompt_book``:
the ledger's "every admitted prompt ends trained exactly once, filtered, or re-queued
with a reason") before the queue that hands it its stale drops. Picking and replacing
rollout workers is ``async_rl.control.rollout_pool``'s; which failures stop the run,
``async_rl.control.run_health``'s; what a checkpoint holds and the order of its writes,
``async_rl.control.checkpoint_parts``'; reading the workers' usage and spans,
``async_rl.control.worker_readings``'. A group's members are the samples the policy
wrote and the task scored (``Group.members``); the rest are counted by reason. It sees
workers only through ``async_rl.control.protocols`` and groups only as metadata (the
tokens stay with the workers). Knows nothing about Ray (``async_rl.shell.ray_shell``
starts the workers and hands them in), how engines generate or shards compute, nor the
rules of the gate, queue and plan (buffers/).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectSendStream

from async_rl.analysis.idle import ROLLOUT_TRACK, TRAINER_TRACK
from async_rl.config import Config
from async_rl.control.checkpoint_files import RunState
from async_rl.control.checkpoint_parts import RunCheckpoints
from async_rl.control.evaluation import EvalLog
from async_rl.control.evaluation_runner import EvaluationRunner
from async_rl.control.failures import RunFailed, first_error
from async_rl.control.live_tuning import LiveTuning
from async_rl.control.loss_stats import role_metrics
from async_rl.control.prompt_book import PromptBook
from async_rl.control.prompt_ledger import PromptLedger
from async_rl.control.protocols import PublishedWeights, Workers
from async_rl.control.role_stages import step_stages
from async_rl.control.rollout_admission import RolloutAdmission, group_rules
from async_rl.control.rollout_pool import RolloutPool
from async_rl.control.run_health import RunHealth
from async_rl.control.step_metrics import StepTotals, step_row
from async_rl.control.step_stages import StepUpdate
from async_rl.control.trainer_policy import TrainerPolicy
from async_rl.control.worker_readings import WorkerReadings
from async_rl.run.progress import RunProgress
from async_rl.run.run_dir import FINAL_MODEL, RunWriter
from async_rl.run.summary import EvalPoint, RunSummary
from async_rl.tasks.sources import PromptSource
from buffers.common.records import Group, Prompt
from buffers.common.reports import BroadcastTiming
from buffers.plan.balance import StepPlan
from buffers.plan.batching import shard_batches
from buffers.queue.queue_records import TakenGroups
from buffers.queue.replay_queue import ReplayQueue
from buffers.queue.staleness import AdmissionGate
from workers.common.spans import SpanRecorder

log = logging.getLogger(__name__)


class Orchestrator:
    """Runs one async GRPO job on started workers; see the module docstring."""

    def __init__(self, config: Config, out: RunWriter, source: PromptSource,
                 eval_prompts: Sequence[Prompt], workers: Workers,
                 clock: Callable[[], float] | None = None) -> None:
        """``clock``: the one time source of the run (durations, spans, the ledger, the
        queue's and gate's waits); None: the system's (``time.perf_counter`` for
        durations, ``time.time`` for spans and the ledger). ``async-rl simulate`` passes
        its virtual clock, which its event loop's timers also run on."""
        self.config, self.out = config, out
        self.clock = clock or time.perf_counter
        wall = clock or time.time
        self.trainers, self.weights = workers.trainers, workers.weights
        self.policy = TrainerPolicy(self.trainers[0], out.path)
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
        self.timings: list[BroadcastTiming] = []
        """Broadcast timings completed since the last metrics row."""

        # The run's own bookkeeping, each part built before the parts that use it.
        self.totals = StepTotals(bucket_edges=config.queue.bucket_edges)
        self.health = RunHealth.from_config(config.trainer, config.rollout, self.totals,
                                            clock=self.clock)
        self.stages = step_stages(config, workers, self.health)
        self.pool = RolloutPool.from_config(config.rollout, workers, totals=self.totals,
                                            current_policy=self.policy.written_for,
                                            call_timeout_s=config.run.call_timeout_s)
        self.prompts = PromptLedger.from_config(config.run, out, self.policy.current,
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

        # The data path (buffers/): the gate in front of the workers, the queue behind;
        # the book takes back what either gives up (the queue's stale drops included).
        self.gate = AdmissionGate.from_config(
            config.staleness, groups_per_step=config.trainer.groups_per_step,
            clock=self.clock)
        self.book = PromptBook(source, self.prompts, self.gate, self.totals, self.health)
        # A group's entering version splits its staleness into in flight and in queue.
        self.queue: ReplayQueue[Group] = ReplayQueue.from_config(
            config.queue, config.staleness, on_drop=self.book.on_drop, clock=self.clock,
            policy_version=self.policy.current)
        self.admitting = RolloutAdmission(group_rules(config), self.book, gate=self.gate,
                                          pool=self.pool, queue=self.queue,
                                          span=self.admission)
        # The live keys, retuned between steps by [autopilot] (the config's, without it).
        self.tuning = LiveTuning(config, out, pool=self.pool, queue=self.queue, gate=self.gate,
                                 clock=self.clock, lending=workers.lending)
        # What a checkpoint gathers from all of the above.
        self.checkpoints = RunCheckpoints.from_config(
            config.run, config.trainer, out, self.gate, source, self.totals, self.prompts,
            self.evals, self.queue, workers.tokens, tuned=self.tuning.state)

    @property
    def version(self) -> int:
        """The policy's version now."""
        return self.policy.version

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
                if self.stop_reason:  # a clean stop: the engines hand their rollouts back
                    remaining = self.stop_deadline - anyio.current_time()
                    await self.admitting.hand_back(
                        max(2.0, min(remaining, self.config.run.call_timeout_s)))
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
            self.out.sessions(await self.readings.sessions())
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
        """Take a step's groups, plan, run the step's stages on every shard, publish the
        new version (delivered beside the next steps), record the step, retune the live
        keys at a window's end ([autopilot]). A step that did not move the policy (lost
        groups, a non-finite gradient, a critic warm-up step) runs its prompts again."""
        step, shards = self.first_step, self.config.trainer.num_shards
        self.training.flush()  # the track starts with the loop: setup and evaluation dropped
        # Published versions go to the rollout workers one at a time, in version order,
        # beside the next steps; leaving the block waits for the last delivery.
        to_deliver, published = anyio.create_memory_object_stream[PublishedWeights](math.inf)
        async with anyio.create_task_group() as beside, to_deliver:
            beside.start_soon(self.delivery_loop, published)
            while step <= self.config.run.num_steps and not self.stop_reason:
                started = self.clock()
                took = await self._take()
                if took is None:
                    break  # a stop's deadline passed before the step had its groups
                groups, taken = took.groups, self.clock()
                batches, plan = shard_batches(groups, shards, self.tuning.trainer, step,
                                              max_new_tokens=self.config.rollout.max_new_tokens)
                async with self.policy.lock:  # the version moves with the weights
                    await self.stages.prepare(batches, step)  # (reference, values)
                    await self.stages.advantages(step)
                    update = await self.stages.update(batches, step)
                    if not update.untrained:
                        self.policy.version += 1
                self.health.progressed()
                if update.untrained:  # the policy did not move: the step's prompts run again
                    self.book.untrained(groups, update.untrained)
                    continue
                trained = self.clock()
                self.book.trained(groups, version=self.version - 1)
                if self.stop_reason:  # no step follows: nothing more is admitted
                    self.admitting.stop_admitting()
                await self._publish(to_deliver)
                await self._record(bar, step, took, plan, update,
                                   times=(started, taken, trained))
                await self._checkpoint_if_due(step, beside)
                await self.tuning.after_step(step, len(groups), update.results,
                                             wait_s=taken - started,
                                             tokens=sum(g.num_tokens for g in groups))
                step += 1
            self.training.switch("checkpoint")
            await self.checkpoints.wait_written()
            self.training.switch("weight_publish")  # the last delivery, awaited on exit

    async def _take(self) -> TakenGroups[Group] | None:
        """The step's groups, in prompt order; None when a requested stop's deadline
        passed before they came (they stay owed: the checkpoint keeps their prompts)."""
        self.training.switch("wait_data", self.version)
        with anyio.CancelScope(deadline=self.stop_deadline) as taking:
            self._taking = taking
            groups = await self.queue.take_groups(self.config.trainer.groups_per_step,
                                                  at_version=self.version,
                                                  homogeneous=self.config.queue.homogeneous_take)
        self._taking = None
        if taking.cancelled_caught:
            return None
        self.training.switch("training")
        # Prompt order, not arrival order: the same groups then train in the same
        # mini-batches and sums whatever the generation's timing (a whitened step's
        # near-zero gradients would otherwise flip sign with the order under Adam).
        return groups.sorted_by(lambda g: (g.prompt.prompt_id, g.prompt.attempt))

    async def _publish(self, to_deliver: MemoryObjectSendStream[PublishedWeights]) -> None:
        """Publishes the new version every weights.sync_every versions (the delivery
        runs beside the next steps)."""
        if self.version % self.config.weights.sync_every == 0:
            self.training.switch("weight_publish", self.version)
            to_deliver.send_nowait(await self.weights.publish(self.version))

    async def _record(self, bar: RunProgress, step: int, groups: TakenGroups[Group],
                      plan: StepPlan, update: StepUpdate,
                      times: tuple[float, float, float]) -> None:
        """The metrics row of the step that trained ``groups`` (``times``: when its take
        started, when it had its groups, when it trained), its throughput for the
        evaluations' clock, the evaluation the new version is due, the progress line."""
        started, taken, trained = times
        timings, self.timings = self.timings, []
        row = step_row(
            step=step, version=self.version, taken=groups, results=update.results, plan=plan,
            wait_s=taken - started, train_s=trained - taken, sync_s=self.clock() - trained,
            timings=timings, queue=self.queue.statistics(), totals=self.totals,
            trainer=self.config.trainer,
        ) | role_metrics(update.results, update.critic, measured_kl=self.config.has_reference
                         ) | self.tuning.columns()
        self.out.metrics(row)
        self.evals.produced(self.version, trained, samples=self.totals.samples_trained,
                            groups=self.totals.groups_trained,
                            tokens=self.totals.tokens_trained)
        await self.evaluations.version_trained(self.version)
        bar.update(row)

    async def _checkpoint_if_due(self, step: int, beside: anyio.abc.TaskGroup) -> None:
        """A checkpoint every run.checkpoint_every steps (not after the last: the run's
        end saves one). The shards snapshot in order with training; the write runs
        beside the next steps (``beside`` awaits it on exit)."""
        every = self.config.run.checkpoint_every
        if every and step % every == 0 and step < self.config.run.num_steps:
            self.training.switch("checkpoint", self.version)
            await self.checkpoints.save(self.version, self.clock() - self.evals.started,
                                        self.trainers[0], background=beside)

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
        """Ends the run cleanly after the step in progress: no new step starts, and no
        prompt is admitted once it has trained. A step still waiting for its groups gets
        run.stop_timeout_s more; then it is abandoned (its groups stay owed: the
        checkpoint keeps their prompts). The engines then hand their rollouts in
        progress back, and the checkpoint keeps them (``RolloutAdmission.hand_back``).
        Call it in the run's event loop."""
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
        weights), counters and cursor; its queued groups back in the queue (those still
        within the staleness bound are trained), its other unfinished prompts issued
        first.
        ``refused``: newer checkpoints that did not verify (restore failures)."""
        self.policy.version = state.version
        self.first_step = state.step + 1
        self.wall_offset = state.wall_s
        self.stages.resumed()
        self.tuning.restore(state.autopilot)  # before the queue's groups are back in it
        self.checkpoints.restore(state, refused)
