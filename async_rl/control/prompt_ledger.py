"""The prompt ledger: every admitted prompt's life, and the prompts still owed a training.

Owns: writing each event of a prompt to ``ledger.jsonl`` (admitted, generated, trained,
dropped or failed and re-queued with a reason, dropped for good as filtered, unfinished
at the end, re-queued or restored to the queue on resume, handed back by an engine as a
partial rollout and restored as one on resume) and the sets behind the run's "nothing
lost, nothing trained twice": the prompts admitted and not yet trained (``open``), those
waiting to run again (``requeued``, handed out before new ones) and the partial rollouts
waiting to be continued (``partials``, handed out first). Trained and filtered events
carry the group's members' rewards only, as generated events carry the members' lengths.
A filtered prompt (its group had no GRPO signal, rollout.filter_groups) is accounted,
not owed: it leaves ``open`` and is not re-queued, as DAPO samples more instead. Knows
nothing about the gate, the queue or workers: the orchestrator says what happened.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

import msgspec

from async_rl.config import RunConfig
from async_rl.run.run_dir import RunWriter
from async_rl.tasks.sources import PromptSource
from buffers.common.partials import PartialGroup
from buffers.common.records import Group, Prompt
from buffers.common.reports import LedgerEntry
from buffers.plan.group_verdict import GroupVerdict

FILTERED = "filtered"
"""The reason of a final drop: rollout.filter_groups found the group without signal."""
READMISSIONS_EXHAUSTED = "readmissions_exhausted"
"""The reason of a final drop: the prompt already ran again run.max_readmissions times."""


class PromptLedger:
    """A run's prompts in flight, owed, and their events; ``version`` labels each event."""

    @classmethod
    def from_config(cls, run: RunConfig, out: RunWriter, version: Callable[[], int], *,
                    clock: Callable[[], float] = time.time) -> PromptLedger:
        """The ledger of ``out``, re-admitting a prompt at most run.max_readmissions times."""
        return cls(out, version, clock=clock, max_readmissions=run.max_readmissions)

    def __init__(self, out: RunWriter, version: Callable[[], int],
                 clock: Callable[[], float] = time.time, max_readmissions: int = 4) -> None:
        """``max_readmissions``: run.max_readmissions."""
        self._out, self._version, self._clock = out, version, clock
        self.max_readmissions = max_readmissions
        self.requeued: deque[Prompt] = deque()
        self.open: dict[str, Prompt] = {}
        """Admitted and not yet trained or re-queued: in flight or in the queue."""
        self.partials: deque[PartialGroup] = deque()
        """Handed back by an engine with tokens kept, not yet continued: neither open nor
        owed (a checkpoint keeps them whole)."""

    def write(self, prompt: Prompt, event: str, *, reason: str = "",
              version: int | None = None, rewards: tuple[float, ...] = (),
              lengths: tuple[int, ...] = ()) -> None:
        self._out.ledger(LedgerEntry(
            prompt_id=prompt.prompt_id, event=event,
            version=self._version() if version is None else version,
            attempt=prompt.attempt, reason=reason, time=self._clock(), rewards=rewards,
            lengths=lengths,
        ))

    def admit(self, source: PromptSource) -> Prompt | PartialGroup:
        """The next work to run: a partial rollout to continue first (event "admitted",
        reason "continue", with its kept lengths), then a re-queued prompt, else a new
        one from ``source``."""
        if self.partials:
            partial = self.partials.popleft()
            self.write(partial.prompt, "admitted", reason="continue",
                       lengths=partial.kept_lengths)
            self.open[partial.prompt.prompt_id] = partial.prompt
            return partial
        prompt = self.requeued.popleft() if self.requeued else source.next_prompt()
        self.write(prompt, "admitted")
        self.open[prompt.prompt_id] = prompt
        return prompt

    def handed_back(self, partial: PartialGroup) -> None:
        """An engine handed ``partial`` back (event "handed_back", reason "stop", or
        "engine_stopped" when the engine stopped itself, with the kept lengths): it is
        continued later, first in line; with nothing kept its prompt runs again, the
        same attempt (it was cut short, not failed)."""
        prompt = partial.prompt
        self.write(prompt, "handed_back", reason="engine_stopped" if partial.leaving else "stop",
                   lengths=partial.kept_lengths)
        self.open.pop(prompt.prompt_id, None)
        if partial.samples:
            self.partials.append(partial)
        else:
            self.write(prompt, "requeued", reason=partial.restarts or "not_started")
            self.requeued.append(prompt)

    def restore_partial(self, partial: PartialGroup) -> None:
        """A resumed run's partial rollout from its checkpoint (event "partial_restored",
        reason "resume", with the kept lengths): continued first."""
        self.write(partial.prompt, "partial_restored", reason="resume",
                   lengths=partial.kept_lengths)
        self.partials.append(partial)

    def generated(self, prompt: Prompt, verdict: GroupVerdict) -> bool:
        """``prompt``'s group came back: its "generated" event carries the members'
        lengths (what ``async-rl simulate --lengths RUN_DIR`` replays); unless it goes on
        to the queue, the prompt then runs again (``requeue``, event "dropped") or is
        filtered. False: it ran again ``max_readmissions`` times and is dropped for good."""
        group = verdict.group
        self.write(prompt, "generated",
                   lengths=tuple(group.completion_lengths[k] for k in group.members))
        if verdict.requeue:
            return self.requeue(prompt, "dropped", verdict.requeue)
        if verdict.informative is False:
            self.filtered(group)
        return True

    def trained(self, group: Group, version: int) -> None:
        """``group`` trained at ``version``: its prompt is done; the event carries the
        members' rewards (``Group.member_rewards``: an excluded sample's are left out)."""
        self.open.pop(group.prompt_id, None)
        self.write(group.prompt, "trained", version=version, rewards=group.member_rewards)

    def filtered(self, group: Group) -> None:
        """``group`` had no signal: dropped (reason filtered) and done, not run again; the
        event carries the members' rewards, as ``trained``'s."""
        self.open.pop(group.prompt_id, None)
        self.write(group.prompt, "dropped", reason=FILTERED, rewards=group.member_rewards)

    def requeue(self, prompt: Prompt, event: str, reason: str) -> bool:
        """``event`` (dropped, failed) and the prompt runs again, as its next attempt;
        False: it already ran again ``max_readmissions`` times and is dropped for good."""
        self.write(prompt, event, reason=reason)
        self.open.pop(prompt.prompt_id, None)
        if prompt.attempt >= self.max_readmissions:
            self.write(prompt, "dropped", reason=READMISSIONS_EXHAUSTED)
            return False
        self.requeued.append(msgspec.structs.replace(prompt, attempt=prompt.attempt + 1))
        self.write(prompt, "requeued", reason=reason)
        return True

    def owed(self) -> tuple[Prompt, ...]:
        """Every prompt admitted or re-queued and not trained (what a checkpoint keeps)."""
        return (*self.requeued, *self.open.values())

    def reissue(self, prompts: Iterable[Prompt]) -> None:
        """A resumed run's owed prompts, first in line. The same attempt again: it was
        cut short, not failed or dropped, so with rollout.sampling_seed it samples what
        it would have without the stop."""
        for prompt in prompts:
            self.write(prompt, "requeued", reason="resume")
            self.requeued.append(prompt)

    def restored(self, groups: Iterable[Group]) -> None:
        """A resumed run's queued groups, back in its queue from the checkpoint: their
        prompts are open again (event "restored", reason "resume"), and go on to be
        trained (or dropped as stale) without being generated again."""
        for group in groups:
            self.write(group.prompt, "restored", reason="resume")
            self.open[group.prompt_id] = group.prompt

    def close(self) -> None:
        """The run ended: what was generated or queued, or handed back, and never trained
        is unfinished."""
        for prompt in (*self.open.values(), *(p.prompt for p in self.partials)):
            self.write(prompt, "unfinished", reason="run_ended")
