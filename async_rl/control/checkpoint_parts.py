"""A run's checkpoints as the orchestrator takes them and gives them back.

Owns: which parts of a run a checkpoint holds (the gate's counters, the prompt cursor, the
prompts admitted but not trained, the step counters, the evaluations, the run files'
positions), gathered from those parts when one is taken and handed back to them on
resume; and the order of writes: the trainer snapshots in order with training, the write
and rename may run in the background, one at a time, each waited for before the next
begins. When a checkpoint falls due is the orchestrator's; the files, their layout and
their checks are ``async_rl.control.checkpoint_files``'s. Knows nothing about Ray or what the
trainer writes into its folder.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import anyio
import anyio.abc

from async_rl.config import RunConfig
from async_rl.control.checkpoint_files import RunState, begin_checkpoint, finish_checkpoint
from async_rl.control.evaluation import EvalLog
from async_rl.control.prompt_ledger import PromptLedger
from async_rl.control.protocols import TrainerClient
from async_rl.control.step_metrics import StepTotals
from async_rl.run.run_dir import RunWriter
from async_rl.tasks.sources import PromptSource
from buffers.queue.staleness import AdmissionGate
from workers.common.errors import first_line
from workers.trainer.config import TrainerConfig


class RunCheckpoints:
    """Takes and restores the checkpoints of one run; see the module docstring."""

    @classmethod
    def from_config(cls, run: RunConfig, trainer: TrainerConfig, out: RunWriter,
                    gate: AdmissionGate, source: PromptSource, totals: StepTotals,
                    prompts: PromptLedger, evals: EvalLog) -> RunCheckpoints:
        """Checkpoints of trainer.backend's state, run.keep_checkpoints of them kept."""
        return cls(out, gate, source, totals, prompts, evals, backend=trainer.backend,
                   keep=run.keep_checkpoints)

    def __init__(self, out: RunWriter, gate: AdmissionGate, source: PromptSource,
                 totals: StepTotals, prompts: PromptLedger, evals: EvalLog, *,
                 backend: str, keep: int) -> None:
        """``backend``: trainer.backend, recorded so the other backend refuses it;
        ``keep``: run.keep_checkpoints."""
        self.out, self.gate, self.source = out, gate, source
        self.totals, self.prompts, self.evals = totals, prompts, evals
        self.backend, self.keep = backend, keep
        self.written: anyio.Event | None = None
        """Set when the last checkpoint started in the background is renamed into place."""

    async def save(self, version: int, wall_s: float, saver: TrainerClient, *,
                   background: anyio.abc.TaskGroup | None = None) -> None:
        """A checkpoint of the last completed step (``version``): prompts admitted but
        not trained (in flight, queued or re-queued) are saved to be issued again. The
        trainer's state comes from ``saver`` (with ddp the shards are replicas, with
        fsdp2 the client gathers every shard's part).

        ``background``: returns once the trainer holds its snapshot; the write, then the
        rename, run in this task group (``wait_written`` waits for them). An earlier
        checkpoint's write is waited for first: they complete in step order.
        """
        await self.wait_written()
        # Every admission slot not spent on a trained group goes back: those of open
        # prompts, and any the rollout loop held while it waited for a free worker.
        unspent = self.gate.statistics().started - self.totals.groups_trained
        state = RunState(
            step=version, version=version,
            gate=self.gate.snapshot(in_flight=unspent),
            source=self.source.state(), reissue=self.prompts.owed(),
            counters=self.totals.counters(), evals=tuple(self.evals.points),
            wall_s=wall_s, files=self.out.positions, trainer_backend=self.backend,
        )
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
        continue from it, its unfinished prompts are issued first. ``refused``: newer
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
