"""The rollout side of a run: prompts through the gate to a worker, groups into the queue.

Owns: ``RolloutAdmission``, the loop that admits prompts (``AdmissionGate``) and hands
each to the least-busy live rollout worker (``RolloutPool``), then each generated group
in one pass: judged (``buffers.plan.group_verdict``: reward failures zeroed on request;
environment failures, groups with fewer than two members re-queued; groups without
signal filtered), accounted (``PromptBook``: the ledger, the counts, the slot given back)
and, if it goes on, put in the ``ReplayQueue`` (waiting there is backpressure). A
partial rollout an engine handed back goes to the book, and is later continued on a
worker that can (``HandsBack``; one that cannot generates its prompt anew); one handed
back by an engine that stops itself retires that engine. At a clean stop of the run
(``hand_back``) no prompt is admitted any more and every worker hands its rollouts back.
Knows nothing about training, weights or Ray.
"""

from __future__ import annotations

import logging

import anyio

from async_rl.config import Config
from async_rl.control.failures import RolloutFailed
from async_rl.control.prompt_book import PromptBook
from async_rl.control.protocols import HandsBack, RolloutClient
from async_rl.control.rollout_pool import RolloutPool
from buffers.common.partials import PartialGroup
from buffers.common.records import NO_VERSION, Group, Prompt
from buffers.plan.group_verdict import GroupRules, group_verdict
from buffers.queue.replay_queue import ReplayQueue
from buffers.queue.staleness import AdmissionGate
from workers.common.spans import SpanRecorder

log = logging.getLogger(__name__)


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
        self._admitting = anyio.CancelScope()
        """The loop's admissions: cancelled, no prompt is admitted any more."""
        self._running = 0
        self._idle = anyio.Event()
        """Set while no worker call is in flight (a group waiting for room in the queue
        is not: a stop does not wait for it, its prompt stays owed)."""
        self._idle.set()

    async def loop(self) -> None:
        """Admits prompts through the gate and hands each to the least-busy live worker."""

        def waiting() -> None:
            # Slots held by groups blocked on a full queue are backpressure.
            full = self.queue.statistics().put_waits.waiting_now > 0
            self.admission.switch("queue_full" if full else "admitting")

        self.admission.flush()  # the track starts with the loop: setup and evaluation dropped
        async with anyio.create_task_group() as generations:
            with self._admitting:
                while True:
                    if not self.gate.open_slots:
                        self.admission.switch("gate_closed", self.gate.version)
                    await self.gate.acquire()
                    rank, worker = await self.pool.acquire(waiting)
                    self.admission.switch("admitting", self.gate.version)
                    work = self.book.admit()
                    self._started()
                    generations.start_soon(self.generate, rank, worker, work)
            await anyio.sleep_forever()  # stopped admitting: the run cancels the loop

    def stop_admitting(self) -> None:
        """No prompt is admitted from now on (a clean stop: the step in progress has its
        groups, or gave up on them); the generations in flight go on."""
        self._admitting.cancel()

    async def hand_back(self, timeout_s: float) -> None:
        """A clean stop's hand-back: no prompt admitted any more, every live worker that
        can hands its rollouts back, and the generations in flight end (the partial
        groups to the book) within ``timeout_s``; what is still in flight then stays owed
        (its prompt runs again on resume)."""
        self.stop_admitting()
        workers = [w for w in self.pool.workers.values() if isinstance(w, HandsBack)]

        async def one(worker: HandsBack) -> None:
            try:
                await worker.hand_back()
            except RolloutFailed as failed:  # lost: its rollouts stay owed
                log.info("a rollout worker could not hand its rollouts back: %s",
                         failed.reason)

        with anyio.move_on_after(timeout_s):
            async with anyio.create_task_group() as calls:
                for worker in workers:
                    calls.start_soon(one, worker)
            await self._idle.wait()

    def _started(self) -> None:
        if not self._running:
            self._idle = anyio.Event()
        self._running += 1

    def _ended(self) -> None:
        self._running -= 1
        if not self._running:
            self._idle.set()

    async def generate(self, rank: int, worker: RolloutClient,
                       work: Prompt | PartialGroup) -> None:
        """One prompt (or a partial rollout to continue) on one worker, its group judged
        and accounted, then into the queue (waiting there is backpressure); a partial
        group handed back goes to the book."""
        partial = work if isinstance(work, PartialGroup) else None
        prompt = work.prompt if isinstance(work, PartialGroup) else work
        try:
            # Every live engine runs the gate's version, so the group's tokens are no
            # older (a continuation's are as old as its oldest kept token): a take that
            # must hold the group waits for it (wait_for_expiring).
            oldest = self.gate.version
            if partial is not None and partial.min_version != NO_VERSION:
                oldest = min(oldest, partial.min_version)
            try:
                with self.queue.expecting(oldest):
                    if partial is None:
                        result = await worker.generate(prompt)
                    elif isinstance(worker, HandsBack):
                        result = await worker.continue_group(partial)
                    else:  # a worker that cannot continue it generates the prompt anew
                        result = await worker.generate(prompt)
            finally:  # a group waiting for room in the queue is not waited for
                self._ended()
            if isinstance(result, PartialGroup):
                self.book.handed_back(result)
                if result.leaving:  # the engine stops itself: it is replaced
                    self.pool.retire(rank, worker, "it stopped itself, its rollouts "
                                     "handed back")
                return
            group: Group = result
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
