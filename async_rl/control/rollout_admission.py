"""The rollout side of a run: prompts through the gate to a worker, groups into the queue.

Owns: ``RolloutAdmission``, the loop that admits prompts (``AdmissionGate``) and hands
each to the least-busy live rollout worker (``RolloutPool``), and what happens to each
generated group before the queue: reward failures zeroed on request, environment
failures re-queued on request, groups with fewer than two members re-queued, groups
without signal filtered (rollout.filter_groups), the rest put in the ``ReplayQueue``
(waiting there is backpressure). Every prompt it gives back goes through ``requeue``,
which the training side uses too, so the ledger sees one way back. Knows nothing about
training, weights or Ray.
"""

from __future__ import annotations

import anyio

from async_rl.config import TaskConfig
from async_rl.control.prompt_ledger import PromptLedger
from async_rl.control.protocols import RolloutClient, RolloutFailed
from async_rl.control.rollout_pool import RolloutPool
from async_rl.control.run_health import RunHealth
from async_rl.control.step_metrics import StepTotals
from async_rl.tasks.sources import PromptSource
from buffers.common.records import Group, Prompt
from buffers.plan.advantages import has_signal
from buffers.plan.batching import training_rewards, with_reward_failures
from buffers.queue.queue_records import Dropped
from buffers.queue.replay_queue import ReplayQueue
from buffers.queue.staleness import AdmissionGate
from workers.common.spans import SpanRecorder
from workers.rollout.config import RolloutConfig
from workers.trainer.config import TrainerConfig


class RolloutAdmission:
    """The rollout side of one run; see the module docstring."""

    def __init__(self, *, task: TaskConfig, rollout: RolloutConfig, trainer: TrainerConfig,
                 source: PromptSource, gate: AdmissionGate, pool: RolloutPool,
                 prompts: PromptLedger, totals: StepTotals, health: RunHealth,
                 span: SpanRecorder, queue: ReplayQueue[Group]) -> None:
        """``trainer``: how advantages see rewards (the filter's judgement); ``span``: the
        orchestrator's admission track; the queue's stale drops must come back through
        ``on_drop``."""
        self.task, self.rollout, self.trainer = task, rollout, trainer
        self.source, self.gate, self.pool = source, gate, pool
        self.prompts, self.totals, self.health = prompts, totals, health
        self.admission = span
        self.queue = queue

    async def loop(self) -> None:
        """Admits prompts through the gate and hands each to the least-busy live worker."""

        def waiting() -> None:
            # Slots held by groups blocked on a full queue are backpressure.
            full = self.queue.statistics().put_waits.waiting_now > 0
            self.admission.switch("queue_full" if full else "admitting")

        self.admission.flush()  # the track starts with the loop: setup and evaluation dropped
        async with anyio.create_task_group() as generations:
            while True:
                if not self.gate.open_slots:
                    self.admission.switch("gate_closed", self.gate.version)
                await self.gate.acquire()
                rank, worker = await self.pool.acquire(waiting)
                self.admission.switch("admitting", self.gate.version)
                prompt = self.prompts.admit(self.source)
                generations.start_soon(self.generate, rank, worker, prompt)

    async def generate(self, rank: int, worker: RolloutClient, prompt: Prompt) -> None:
        """One prompt on one worker, then into the queue (waiting there is backpressure)."""
        try:
            # Every live engine runs the gate's version, so the group's tokens are no
            # older: a take that must hold the group waits for it (wait_for_expiring).
            with self.queue.expecting(self.gate.version):
                group = await worker.generate(prompt)
            if self.task.on_reward_failure == "zero":
                group = with_reward_failures(group)
            self.totals.generated(group)
            # The members' lengths: what ``async-rl simulate --lengths RUN_DIR`` replays.
            self.prompts.write(prompt, "generated", lengths=tuple(
                group.completion_lengths[k] for k in group.members))
            env = self.task.environment
            if group.env_timeouts and env.on_timeout == "requeue":
                self.requeue(prompt, "dropped", "env_timeout")  # the group runs again
                return
            if group.env_errors and env.on_error == "requeue":
                self.requeue(prompt, "dropped", "env_error")
                return
            if len(group.members) < 2:  # no GRPO group: nothing to compare a member with
                self.totals.too_few_members += 1
                self.requeue(prompt, "dropped", "too_few_members")
                return
            if self.filtered(group):
                return
            # The worker's slot stays taken until the queue has room: backpressure. A
            # group dropped as stale there is no progress (its prompt runs again).
            if await self.queue.put(group):
                self.health.progressed()
        except RolloutFailed as failed:
            self.health.rollout_failed(failed)
            if failed.worker_gone:
                self.pool.retire(rank, worker, failed.reason)  # dead, broken or stuck
            self.requeue(prompt, "failed", f"rollout_error:{failed.reason}")
        finally:
            await self.pool.release(rank)


    def filtered(self, group: Group) -> bool:
        """rollout.filter_groups (DAPO's dynamic sampling): a group whose rewards, as its
        advantages see them, are all equal is dropped before the queue, for good (the
        ledger accounts it; it is not run again), and its admission slot goes to a fresh
        prompt. Too many in a row stop the run (``RunHealth.judged``)."""
        if self.rollout.filter_groups == "none":
            return False
        informative = has_signal(training_rewards(group, self.trainer,
                                                  self.rollout.max_new_tokens))
        if not informative:
            self.gate.release()
            self.prompts.filtered(group)
        self.health.judged(informative)
        return not informative

    def on_drop(self, dropped: Dropped[Group]) -> None:
        """A group the queue dropped as stale: its prompt runs again."""
        self.totals.dropped(dropped.item)
        self.requeue(dropped.item.prompt, "dropped", dropped.reason)

    def requeue(self, prompt: Prompt, event: str, reason: str) -> None:
        """Gives the prompt's admission slot back and runs it again: nothing is lost
        (past run.max_readmissions it is dropped for good, and counted)."""
        self.gate.release()
        if not self.prompts.requeue(prompt, event, reason):
            self.totals.readmissions_exhausted += 1
