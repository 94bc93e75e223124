"""The rollout side of a run: prompts through the gate to a worker, groups into the queue.

Owns: ``RolloutAdmission``, the loop that admits prompts (``AdmissionGate``) and hands
each to the least-busy live rollout worker (``RolloutPool``), then each generated group
in one pass: judged (``buffers.plan.group_verdict``: reward failures zeroed on request;
environment failures, groups with fewer than two members re-queued; groups without
signal filtered), accounted (``PromptBook``: the ledger, the counts, the slot given back)
and, if it goes on, put in the ``ReplayQueue`` (waiting there is backpressure). Knows
nothing about training, weights or Ray.
"""

from __future__ import annotations

import anyio

from async_rl.config import Config
from async_rl.control.prompt_book import PromptBook
from async_rl.control.protocols import RolloutClient, RolloutFailed
from async_rl.control.rollout_pool import RolloutPool
from buffers.common.records import Group, Prompt
from buffers.plan.group_verdict import GroupRules, group_verdict
from buffers.queue.replay_queue import ReplayQueue
from buffers.queue.staleness import AdmissionGate
from workers.common.spans import SpanRecorder


def group_rules(config: Config) -> GroupRules:
    """How the run judges its generated groups (task.on_reward_failure, the
    environment's on_timeout and on_error, rollout.filter_groups; the filter sees the
    rewards as the trainer's advantages do)."""
    env = config.task.environment
    return GroupRules(trainer=config.trainer, max_new_tokens=config.rollout.max_new_tokens,
                      zero_reward_failures=config.task.on_reward_failure == "zero",
                      requeue_env_timeouts=env.on_timeout == "requeue",
                      requeue_env_errors=env.on_error == "requeue",
                      filter_groups=config.rollout.filter_groups != "none")


class RolloutAdmission:
    """The rollout side of one run; see the module docstring."""

    def __init__(self, rules: GroupRules, book: PromptBook, *, gate: AdmissionGate,
                 pool: RolloutPool, queue: ReplayQueue[Group], span: SpanRecorder) -> None:
        """``span``: the orchestrator's admission track."""
        self.rules, self.book = rules, book
        self.gate, self.pool, self.queue = gate, pool, queue
        self.admission = span

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
                prompt = self.book.admit()
                generations.start_soon(self.generate, rank, worker, prompt)

    async def generate(self, rank: int, worker: RolloutClient, prompt: Prompt) -> None:
        """One prompt on one worker, its group judged and accounted, then into the queue
        (waiting there is backpressure)."""
        try:
            # Every live engine runs the gate's version, so the group's tokens are no
            # older: a take that must hold the group waits for it (wait_for_expiring).
            with self.queue.expecting(self.gate.version):
                group = await worker.generate(prompt)
            verdict = group_verdict(group, self.rules)
            # The worker's slot stays taken until the queue has room: backpressure. A
            # group dropped as stale there is no progress (its prompt runs again).
            if self.book.generated(prompt, verdict) and await self.queue.put(verdict.group):
                self.book.queued()
        except RolloutFailed as failed:
            self.book.failed(prompt, failed)
            if failed.worker_gone:
                self.pool.retire(rank, worker, failed.reason)  # dead, broken or stuck
        finally:
            await self.pool.release(rank)
