"""A run's checkpoints as the orchestrator takes them and gives them back.

Owns: which parts of a run a checkpoint holds (the gate's counters, the prompt cursor,
the replay queue's groups with their tokens, the partial rollouts the engines handed
back, the other prompts admitted but not trained, the step counters, the evaluations,
the run files' positions, what ``[autopilot]`` had tuned), gathered from those parts at
one instant when one is taken and handed back to them on resume (the queue's groups
through the staleness rule as of the resumed version, and so the partial rollouts,
judged by their oldest kept token: a prompt is owed, partial, queued or trained, never
two of them); and the order of writes: the trainer snapshots in order with training,
the write and rename may run in the background, one at a time, each waited for before
the next begins. When a checkpoint falls due is the orchestrator's; the files, their
layout and their checks are ``async_rl.control.checkpoint_files``'s. Knows nothing about
Ray or what the trainer writes into its folder.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
import msgspec

from async_rl.config import RunConfig
from async_rl.control.checkpoint_files import RunState, begin_checkpoint, finish_checkpoint
from async_rl.control.evaluation import EvalLog
from async_rl.control.prompt_ledger import PromptLedger
from async_rl.control.protocols import TokenStore, TrainerClient
from async_rl.control.step_metrics import StepTotals
from async_rl.run.run_dir import RunWriter
from async_rl.run.run_record import AutopilotState
from async_rl.tasks.sources import PromptSource
from buffers.common.records import NO_VERSION, Group
from buffers.common.saved_groups import SavedGroup
from buffers.queue.queue_records import DROP_STALE, ReplayQueueSnapshot
from buffers.queue.replay_queue import ReplayQueue
from buffers.queue.staleness import AdmissionGate
from workers.common.errors import first_line
from workers.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


class RunCheckpoints:
    """Takes and restores the checkpoints of one run; see the module docstring."""

    @classmethod
    def from_config(cls, run: RunConfig, trainer: TrainerConfig, out: RunWriter,
                    gate: AdmissionGate, source: PromptSource, totals: StepTotals,
                    prompts: PromptLedger, evals: EvalLog, queue: ReplayQueue[Group],
                    tokens: TokenStore | None,
                    tuned: Callable[[], AutopilotState | None] = lambda: None
                    ) -> RunCheckpoints:
        """Checkpoints of trainer.backend's state, run.keep_checkpoints of them kept;
        ``tuned``: what ``[autopilot]`` has tuned now (None: no autopilot)."""
        return cls(out, gate, source, totals, prompts, evals, queue, tokens,
                   backend=trainer.backend, keep=run.keep_checkpoints, tuned=tuned)

    def __init__(self, out: RunWriter, gate: AdmissionGate, source: PromptSource,
                 totals: StepTotals, prompts: PromptLedger, evals: EvalLog,
                 queue: ReplayQueue[Group], tokens: TokenStore | None, *,
                 backend: str, keep: int,
                 tuned: Callable[[], AutopilotState | None] = lambda: None) -> None:
        """``tokens``: where the queue's groups' tokens are fetched from and put back
        (None: the queue's groups are not kept, their prompts are owed); ``backend``:
        trainer.backend, recorded so the other backend refuses it; ``keep``:
        run.keep_checkpoints; ``tuned``: what ``[autopilot]`` has tuned now (None: no
        autopilot)."""
        self.out, self.gate, self.source = out, gate, source
        self.totals, self.prompts, self.evals = totals, prompts, evals
        self.queue, self.tokens = queue, tokens
        self.backend, self.keep = backend, keep
        self.written: anyio.Event | None = None
        """Set when the last checkpoint started in the background is renamed into place."""
        self.tuned = tuned

    async def save(self, version: int, wall_s: float, saver: TrainerClient, *,
                   background: anyio.abc.TaskGroup | None = None) -> None:
        """A checkpoint of the last completed step (``version``): the queue's groups
        with their tokens, and the other prompts admitted but not trained (in flight or
        re-queued, or queued with tokens that cannot be had) to be issued again. The
        trainer's state comes from ``saver`` (with ddp the shards are replicas, with
        fsdp2 the client gathers every shard's part).

        ``background``: returns once the trainer holds its snapshot; the write, then the
        rename, run in this task group (``wait_written`` waits for them). An earlier
        checkpoint's write is waited for first: they complete in step order.
        """
        await self.wait_written()
        # Every part at one instant (nothing awaited): the queue's groups, the prompts
        # owed, the gate's slots, the counters and the files' positions agree.
        queued = self.queue.snapshot()
        # Every admission slot not spent on a trained group goes back, but those of the
        # groups the checkpoint keeps: the slots of the other open prompts, and any the
        # rollout loop held while it waited for a free worker.
        unspent = self.gate.statistics().started - self.totals.groups_trained
        state = RunState(
            step=version, version=version, gate=self.gate.snapshot(in_flight=unspent),
            source=self.source.state(), reissue=self.prompts.owed(),
            partials=tuple(self.prompts.partials),
            counters=self.totals.counters(), evals=tuple(self.evals.points),
            wall_s=wall_s, files=self.out.positions, trainer_backend=self.backend,
            autopilot=self.tuned(),
        )
        state = await self._with_queue(state, queued)
        partial = await begin_checkpoint(self.out.path, state.step, saver.save_checkpoint)
        finish = functools.partial(finish_checkpoint, self.out.path, partial, state,
                                   saver.checkpoint_written, self.keep)
        if background is None:
            await finish()
            return
        written = self.written = anyio.Event()

        async def write() -> None:
            try:
                await finish()
            finally:
                written.set()

        background.start_soon(write)

    async def _with_queue(self, state: RunState, queued: ReplayQueueSnapshot[Group]
                          ) -> RunState:
        """``state`` (every prompt owed) with the queued groups whose tokens can be had
        kept instead: their prompts are no longer owed and their slots stay held."""
        if self.tokens is None or not queued.items:
            return state
        fetched = await self.tokens.fetch([group.tokens for group in queued.items])
        saved = tuple(
            SavedGroup(group=group, tokens=tokens, entered_version=entered)
            for group, tokens, entered in zip(
                queued.items, fetched, queued.entered_versions, strict=True)
            if tokens is not None)
        if len(saved) < len(queued.items):
            log.warning("checkpoint of step %d: %d queued groups' tokens are gone with "
                        "their rollout worker; their prompts will run again", state.step,
                        len(queued.items) - len(saved))
        kept = {s.group.prompt_id for s in saved}
        return msgspec.structs.replace(
            state, queue=saved, gate=state.gate.holding(len(saved)),
            reissue=tuple(p for p in state.reissue if p.prompt_id not in kept))

    async def save_after_failure(self, version: int, wall_s: float,
                                 trainers: Sequence[TrainerClient], dead: set[int]) -> str:
        """After a failure: a checkpoint from a live trainer shard when one can write it
        (``dead``: the ranks that cannot); returns what was saved, in words."""
        live = [shard for rank, shard in enumerate(trainers) if rank not in dead]
        if not live:
            return "no live trainer shard to write a checkpoint from"
        if len(live) < len(trainers) and self.backend == "fsdp2":
            return "no checkpoint: every fsdp2 shard holds a part of the state"
        try:
            await self.save(version, wall_s, live[0])
        except Exception as err:  # the failure itself may be what breaks saving
            return f"no checkpoint ({first_line(err)})"
        return f"checkpoint of step {version} written"

    async def wait_written(self) -> None:
        """Returns once the last background checkpoint is in place (or failed: its task
        group raises the error)."""
        if self.written is not None:
            await self.written.wait()

    def restore(self, state: RunState, refused: int) -> None:
        """Hands a checkpoint's parts back: the gate, cursor, counters and evaluations
        continue from it, its unfinished prompts are issued first, and its queued groups
        go back in the queue, judged by the staleness rule at its version (a stale one is
        dropped, its prompt run again, as the queue's stale drops are). ``refused``: newer
        checkpoints that did not verify (counted as restore failures)."""
        self.gate.restore(state.gate)
        if state.gate.version < state.version:  # saved while its delivery still ran
            self.gate.on_version(state.version)  # the engines start from this version
        self.source.restore(state.source)
        self.totals.restore(state.counters)
        self.totals.restore_failures += refused
        self.evals.restore(state.evals, state.version, state.wall_s,
                           samples=self.totals.samples_trained,
                           groups=self.totals.groups_trained, tokens=self.totals.tokens_trained)
        self.prompts.reissue(state.reissue)
        self._restore_partials(state)
        if not state.queue:
            return
        if self.tokens is None:  # no store to put them in: their prompts run again
            self.gate.release(len(state.queue))
            self.prompts.reissue(saved.group.prompt for saved in state.queue)
            return
        tokens = self.tokens
        groups = [msgspec.structs.replace(
            saved.group, tokens=None if saved.tokens is None else tokens.put(saved.tokens))
            for saved in state.queue]
        self.prompts.restored(groups)
        self.queue.readmit(groups, [saved.entered_version for saved in state.queue],
                           at_version=state.version)

    def _restore_partials(self, state: RunState) -> None:
        """The checkpoint's partial rollouts, continued first; one whose oldest kept token
        is already past the staleness bound at the resumed version is dropped as the
        queue's stale groups are (counted, its prompt run again as its next attempt)."""
        for partial in state.partials:
            self.prompts.restore_partial(partial)
            oldest = partial.min_version
            if oldest == NO_VERSION or state.version - oldest <= self.queue.max_staleness:
                continue
            self.prompts.partials.pop()
            self.totals.dropped_tokens(partial.num_tokens)
            if not self.prompts.requeue(partial.prompt, "dropped", DROP_STALE):
                self.totals.readmissions_exhausted += 1
