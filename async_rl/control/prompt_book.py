"""The book of a run's prompts between their admission and their training.

Owns: what every turn of a prompt's life does to the run's accounts, in one place — the
ledger's events (``PromptLedger``), the counts (``StepTotals``), the health rules that
judge generated groups (``RunHealth``) and the admission slots given back to the gate —
for a prompt admitted from the source, its group judged
(``buffers.plan.group_verdict``), queued, dropped as stale by the queue (``on_drop``,
which the queue is built with), handed back by its engine as a partial rollout, failed
on a worker, left untrained by a step, or trained. Every prompt given back goes through
``requeue``, so the ledger sees one way back. Built before the queue and the rollout
side, which both receive it; it references neither. Knows nothing about workers,
training or Ray.
"""

from __future__ import annotations

from collections.abc import Sequence

from async_rl.control.failures import RolloutFailed
from async_rl.control.prompt_ledger import PromptLedger
from async_rl.control.run_health import RunHealth
from async_rl.control.step_metrics import StepTotals
from async_rl.control.step_stages import CRITIC_WARMUP
from async_rl.tasks.sources import PromptSource
from buffers.common.partials import PartialGroup
from buffers.common.records import Group, Prompt
from buffers.plan.group_verdict import TOO_FEW_MEMBERS, GroupVerdict
from buffers.queue.queue_records import Dropped
from buffers.queue.staleness import AdmissionGate


class PromptBook:
    """One run's prompt accounts; see the module docstring."""

    def __init__(self, source: PromptSource, ledger: PromptLedger, gate: AdmissionGate,
                 totals: StepTotals, health: RunHealth) -> None:
        self.source, self.ledger, self.gate = source, ledger, gate
        self.totals, self.health = totals, health

    def admit(self) -> Prompt | PartialGroup:
        """The next work to run (a partial rollout to continue first, then a re-queued
        prompt), in the ledger."""
        return self.ledger.admit(self.source)

    def handed_back(self, partial: PartialGroup) -> None:
        """An engine handed a rollout back: its admission slot is given back, and the
        ledger keeps it to be continued (a checkpoint keeps it whole)."""
        self.gate.release()
        self.ledger.handed_back(partial)

    def generated(self, prompt: Prompt, verdict: GroupVerdict) -> bool:
        """``prompt``'s group came back, judged: counted and in the ledger; unless it
        goes on to the queue (True), its admission slot is given back. Too many groups
        filtered in a row stop the run (``RunHealth.judged``)."""
        self.totals.generated(verdict.group)
        self.totals.too_few_members += verdict.requeue == TOO_FEW_MEMBERS
        if not verdict.queued:
            self.gate.release()
        if not self.ledger.generated(prompt, verdict):
            self.totals.readmissions_exhausted += 1
        if verdict.informative is not None:
            self.health.judged(verdict.informative)
        return verdict.queued

    def queued(self) -> None:
        """A group went into the queue: progress (the stall watch's)."""
        self.health.progressed()

    def failed(self, prompt: Prompt, failed: RolloutFailed) -> None:
        """``prompt``'s generation failed: counted, and the prompt runs again."""
        self.health.rollout_failed(failed)
        self.requeue(prompt, "failed", f"rollout_error:{failed.reason}")

    def on_drop(self, dropped: Dropped[Group]) -> None:
        """A group the queue dropped as stale: counted, and its prompt runs again. The
        queue calls it the moment the group goes stale, even while a take waits: the slot
        must come back at once or the gate could stay shut while training waits."""
        self.totals.dropped(dropped.item)
        self.requeue(dropped.item.prompt, "dropped", dropped.reason)

    def untrained(self, groups: Sequence[Group], reason: str) -> None:
        """A step did not move the policy (``StepUpdate.untrained``): its prompts run
        again (a critic warm-up step's as dropped, a failed step's as failed)."""
        event = "dropped" if reason == CRITIC_WARMUP else "failed"
        for group in groups:
            self.requeue(group.prompt, event, reason)

    def trained(self, groups: Sequence[Group], version: int) -> None:
        """A step trained ``groups`` at ``version``: their prompts are done."""
        for group in groups:
            self.ledger.trained(group, version=version)

    def requeue(self, prompt: Prompt, event: str, reason: str) -> None:
        """Gives the prompt's admission slot back and runs it again: nothing is lost
        (past run.max_readmissions it is dropped for good, and counted)."""
        self.gate.release()
        if not self.ledger.requeue(prompt, event, reason):
            self.totals.readmissions_exhausted += 1
