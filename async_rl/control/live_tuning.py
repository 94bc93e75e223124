"""The live keys of a run, measured into windows and retuned between steps.

Owns: ``LiveTuning``, the orchestrator's part of ``[autopilot]``: the value each live
key has now (the planner's trainer rules among them), the window of steps the autopilot
(``async_rl.control.autopilot``) decides on, measured from what the controller already
has in hand (no worker is called): each step's groups and wall time, the trainer's wait
for data (the step's wait for its groups, the training track's ``wait_data``), its
shards' barrier waits, the admission's waits at the staleness gate (the gate's own count
of seconds) and the rollout slots' waits on a full queue (the queue's seconds of waiting
puts over the slots there were). It applies each move through the components' own
setters, between steps (the pool's ``set_limit``, the queue's ``resize`` and
``set_max_staleness``, the gate's ``set_max_staleness``; the engine count through the
workers' lending, ``EngineLending``: engines added join the pool, removed ones leave
it), and says so: a console line with its cause, run.json's list of changes, the
``autopilot/<key>`` columns of every metrics row. An engine move's switch (the engines'
start) is no part of the window that judges it, nor are the steps that train the groups
queued during it: that window starts once those are trained. A checkpoint keeps the
values in effect and the changes (``state``); a resumed run starts from them
(``restore``: the engines it started with are the shell's,
``async_rl.roster.resumed_engines``).
Without ``[autopilot]`` it holds the config's values and measures nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import anyio
import msgspec

from async_rl.config import Config
from async_rl.control.autopilot import (
    ENGINES,
    INFLIGHT,
    MICRO_BATCH,
    QUEUE,
    STALENESS,
    Autopilot,
    Move,
    Window,
)
from async_rl.control.failures import RolloutFailed
from async_rl.control.protocols import EngineLending
from async_rl.control.rollout_pool import RolloutPool
from async_rl.run.run_dir import RunWriter
from async_rl.run.run_record import AutopilotState
from buffers.common.records import Group
from buffers.common.train_records import ShardStepResult
from buffers.queue.replay_queue import ReplayQueue
from buffers.queue.staleness import AdmissionGate
from workers.trainer.config import TrainerConfig

log = logging.getLogger(__name__)


class LiveTuning:
    """See the module docstring."""

    def __init__(self, config: Config, out: RunWriter, *, pool: RolloutPool,
                 queue: ReplayQueue[Group], gate: AdmissionGate,
                 clock: Callable[[], float], lending: EngineLending | None = None) -> None:
        """``lending``: devices the engine count may take (None: the engines stay)."""
        self.out, self.pool, self.queue, self.gate, self.clock = out, pool, queue, gate, clock
        self.lending = lending
        self.trainer: TrainerConfig = config.trainer
        """The trainer rules the planner lays steps out with (micro_batch_tokens live)."""
        self.autopilot = Autopilot(config, lending) if config.autopilot.enabled else None
        self.every = config.autopilot.every_steps
        self._groups: list[int] = []
        self._tokens = 0
        self._walls: list[float] = []
        self._wait_s = self._barrier_s = 0.0
        self._marks = (0.0, 0.0, 0.0)
        """(clock, gate wait seconds, queue put wait seconds) at the window's start."""
        self._filling = 1
        """Steps to come that are in no window: the loop's first (the pipeline's fill
        would make the first window look starved and every first move look like a
        gain), and after an engine move those of the groups queued during its switch."""
        if self.autopilot is not None and STALENESS in self.autopilot.values:
            # The run starts at the autopilot's ceiling (at most the config's bound).
            self._set(STALENESS, self.autopilot.values[STALENESS])

    def state(self) -> AutopilotState | None:
        """What a checkpoint keeps of the autopilot (None: no autopilot)."""
        return self.autopilot.state() if self.autopilot is not None else None

    def restore(self, saved: AutopilotState | None) -> None:
        """A resumed run goes on from the values and changes a checkpoint kept, each
        applied before the first step (the pool's limit, the queue, the gate, the
        trainer rules); the engine count is the engines in the pool, those the run
        started with. Nothing without the autopilot or a kept state."""
        if self.autopilot is None or saved is None:
            return
        for line in self.autopilot.restore(saved, engines=len(self.pool)):
            log.warning("%s", line)
        for key, value in self.autopilot.values.items():
            if key == INFLIGHT:
                self.pool.restore_limit(value)
            else:
                self._set(key, value)
        self.out.autopilot(self.autopilot.changes)
        log.info("autopilot: resumed at %s", ", ".join(
            f"{key} = {value}" for key, value in self.autopilot.values.items()))

    def columns(self) -> dict[str, int]:
        """Each tuned key's value in effect, for the step's metrics row."""
        if self.autopilot is None:
            return {}
        return {f"autopilot/{key}": value for key, value in self.autopilot.values.items()}

    async def after_step(self, step: int, groups: int,
                         results: Sequence[ShardStepResult], wait_s: float,
                         tokens: int) -> None:
        """A step trained ``groups`` of ``tokens`` in all after waiting ``wait_s`` for
        them; at a window's end, the autopilot's move (if any) applies before the next
        step."""
        if self.autopilot is None:
            return
        if self._filling:
            self._filling -= 1
            self._marks = self._now()
            return
        start_s = self._marks[0] + sum(self._walls)
        self._groups.append(groups)
        self._tokens += tokens
        self._walls.append(self.clock() - start_s)
        self._wait_s += wait_s
        self._barrier_s += sum(r.barrier_s for r in results) / max(len(results), 1)
        if len(self._groups) < self.every:
            return
        window = Window(last_step=step, groups=sum(self._groups), wall_s=sum(self._walls),
                        idle=self._idle(), tokens=self._tokens,
                        groups_per_s=tuple(g / w for g, w in zip(self._groups, self._walls,
                                                                 strict=True) if w > 0))
        self._groups, self._walls, self._wait_s, self._barrier_s = [], [], 0.0, 0.0
        self._tokens = 0
        move = self.autopilot.observe(window)
        for change in self.autopilot.changes:
            if change.judged_step == step:
                log.info("autopilot after step %d: %s = %d %s (%s)", step, change.key,
                         change.new,
                         "kept" if change.outcome == "kept" else "reverted to "
                         f"{change.old}", change.judgement)
        if move is not None:
            await self._apply(step, move)
            if move.key == ENGINES:
                # The switch (an engine's start: tens of seconds on a CPU) is paid once;
                # the window that judges the move measures the pace after it, once the
                # groups the standing engines queued meanwhile are trained.
                switch_s = self.clock() - self._marks[0]
                self._filling = -(-len(self.queue) // self.trainer.groups_per_step)
                self._marks = self._now()
                log.info("autopilot after step %d: the engines moved in %.1f s; the next "
                         "%d step(s) train what was queued meanwhile, in no window", step,
                         switch_s, self._filling)
        if move is not None or any(c.judged_step == step for c in self.autopilot.changes):
            self.out.autopilot(self.autopilot.changes)

    async def _apply(self, step: int, move: Move) -> None:
        if move.key == INFLIGHT:
            await self.pool.set_limit(move.new)
        elif move.key == ENGINES:
            await self._engines(move.new)
        else:
            self._set(move.key, move.new)
        if not move.revert:
            log.info("autopilot after step %d: %s %d -> %d: %s", step, move.key, move.old,
                     move.new, move.cause)

    async def _engines(self, count: int) -> None:
        """Ranks rollout.num_workers up to ``count`` live (each added engine paying its
        switch, all at once), those above it out of the pool and given back."""
        lending = self.lending
        assert lending is not None
        lo, hi = lending.engines
        live = self.pool.workers

        async def add(rank: int) -> None:
            try:
                worker = await lending.add(rank)
            except RolloutFailed as failed:  # it did not start: the run goes on without it
                log.warning("autopilot: rollout-%d was not added: %s", rank, failed.reason)
                return
            await self.pool.join(rank, worker)

        async with anyio.create_task_group() as moves:
            for rank in range(lo, hi):
                if rank < count and rank not in live:
                    moves.start_soon(add, rank)
                elif rank >= count and rank in live:
                    self.pool.leave(rank)
                    moves.start_soon(lending.remove, rank)

    def _set(self, key: str, value: int) -> None:
        """Applies a synchronous live key (the pool's limit is ``_apply``'s)."""
        if key == QUEUE:
            self.queue.resize(value)
        elif key == STALENESS:
            self.gate.set_max_staleness(value)
            self.queue.set_max_staleness(value)
        elif key == MICRO_BATCH:
            self.trainer = msgspec.structs.replace(self.trainer, micro_batch_tokens=value)

    def _now(self) -> tuple[float, float, float]:
        statistics = self.queue.statistics()
        return (self.clock(), self.gate.statistics().wait_seconds,
                statistics.put_waits.seconds)

    def _idle(self) -> dict[str, dict[str, float]]:
        """The window's idle shares by role and cause (see the module docstring); the
        next window starts here."""
        start, gate_s, put_s = self._marks
        self._marks = now, gate_now, put_now = self._now()
        wall = max(now - start, 1e-9)
        slots = max(self.pool.limit * len(self.pool), 1)
        return {"trainer": {"wait_data": self._wait_s / wall,
                            "barrier": self._barrier_s / wall},
                "rollout": {"gate_closed": (gate_now - gate_s) / wall,
                            "queue_full": (put_now - put_s) / (slots * wall)}}
