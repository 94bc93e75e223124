"""RunHealth: which failures a run survives, counts and reports, and which stop it.

Owns: the failure classes' counting (``StepTotals.failures`` holds the counts), the rules
that turn repeated or silent trouble into a named stop — trainer.max_nonfinite_steps
non-finite steps in a row, rollout.max_filtered_in_a_row groups filtered in a row (no
signal: rollout.filter_groups), no progress for rollout.stall_timeout_s — and, once a run
fails, which trainer shards are still alive to write its checkpoint and the one line the
user gets. Knows nothing about workers beyond the protocols' errors, nor about queues.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from async_rl.control.failures import (
    RoleFailed,
    RolloutFailed,
    RunFailed,
    TrainerFailed,
    WaitTimedOut,
    all_errors,
)
from async_rl.control.step_metrics import StepTotals
from async_rl.run.summary import describe_failures
from buffers.common.train_records import ShardStepResult
from workers.common.errors import first_line
from workers.rollout.config import RolloutConfig
from workers.trainer.config import TrainerConfig

ERROR_LOG = "error.log"
"""The traceback of an unexpected error that stopped the run, in the run directory."""


log = logging.getLogger(__name__)

class RunHealth:
    """See the module docstring."""

    @classmethod
    def from_config(cls, trainer: TrainerConfig, rollout: RolloutConfig, totals: StepTotals,
                    *, clock: Callable[[], float] = time.perf_counter) -> RunHealth:
        """The rules of trainer.max_nonfinite_steps, rollout.stall_timeout_s and
        rollout.max_filtered_in_a_row, counting into ``totals``."""
        return cls(totals, max_nonfinite_steps=trainer.max_nonfinite_steps,
                   stall_timeout_s=rollout.stall_timeout_s,
                   max_filtered_in_a_row=rollout.max_filtered_in_a_row, clock=clock)

    def __init__(self, totals: StepTotals, *, max_nonfinite_steps: int,
                 stall_timeout_s: float, max_filtered_in_a_row: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.totals = totals
        self.clock = clock
        """What the stall watch reads (a simulation's virtual clock)."""
        self.max_nonfinite_steps = max_nonfinite_steps
        """trainer.max_nonfinite_steps."""
        self.max_filtered_in_a_row = max_filtered_in_a_row
        """rollout.max_filtered_in_a_row."""
        self.filtered_in_a_row = 0
        """Groups filtered since the last informative one."""
        self.stall_timeout_s = stall_timeout_s
        """rollout.stall_timeout_s."""
        self.last_progress = self.clock()
        """When a group was last generated or a step last trained (the stall watch's)."""
        self.watching = True
        """The stall watch runs while this holds (the training window)."""

    def progressed(self) -> None:
        """A group was generated or a step trained."""
        self.last_progress = self.clock()

    def judged(self, informative: bool) -> None:
        """A group came back and rollout.filter_groups judged it: an uninformative one is
        counted (filtered_groups). Raises ``RunFailed`` at rollout.max_filtered_in_a_row
        in a row: a policy that scores every sample alike would otherwise generate
        forever and never fill a step."""
        self.progressed()
        if informative:
            self.filtered_in_a_row = 0
            return
        self.totals.filtered_groups += 1
        self.filtered_in_a_row += 1
        limit = self.max_filtered_in_a_row
        if self.filtered_in_a_row >= limit:
            raise RunFailed(f"{limit} groups in a row had rewards all equal and were "
                            "filtered (rollout.filter_groups, rollout.max_filtered_in_a_row): "
                            "the policy scores every sample alike, so no step can fill")

    def rollout_failed(self, failed: RolloutFailed) -> None:
        self.totals.rollout_failures += 1
        self.totals.out_of_memory += failed.out_of_memory
        self.totals.timeouts += failed.timed_out

    def untrained_reason(self, step: int, results: Sequence[ShardStepResult]) -> str:
        """Why a step's shards trained nothing ("" when they trained): a shard could not
        fetch its groups (their rollout worker died), or the gradient was not finite
        (the update was skipped). Raises ``RunFailed`` at trainer.max_nonfinite_steps
        non-finite steps in a row: a diverged run stops loudly."""
        if any(r.samples_lost for r in results):
            self.totals.lost_steps += 1
            return "samples_lost"
        if not any(r.nonfinite for r in results):
            self.totals.nonfinite_in_a_row = 0
            return ""
        self.totals.nonfinite_steps += 1
        self.totals.nonfinite_in_a_row += 1
        limit = self.max_nonfinite_steps
        log.warning("step %d: non-finite gradient (norm %s): nothing trained, its prompts "
                    "run again (%d in a row of trainer.max_nonfinite_steps = %d)", step,
                    results[0].grad_norm, self.totals.nonfinite_in_a_row, limit)
        if self.totals.nonfinite_in_a_row >= limit:
            raise RunFailed(f"{limit} steps in a row had a non-finite gradient "
                            "(trainer.max_nonfinite_steps): the policy diverged")
        return "nonfinite"

    async def stall_watch(self, live_workers: Callable[[], int]) -> None:
        """Raises ``RunFailed`` (a rollout stall) once nothing progressed for
        rollout.stall_timeout_s, instead of letting the run hang; returns once
        ``watching`` is cleared."""
        limit = self.stall_timeout_s
        while self.watching:
            await anyio.sleep(min(limit / 4, 1.0))
            quiet = self.clock() - self.last_progress
            if quiet > limit and self.watching:
                self.totals.rollout_stalls += 1
                raise RunFailed(f"rollout stall: no group generated and no step trained for "
                                f"{quiet:.0f} s (rollout.stall_timeout_s = {limit:g}); "
                                f"{live_workers()} live rollout worker(s)")

    def failed(self, failure: Exception, group: BaseExceptionGroup[BaseException]
               ) -> set[int]:
        """Counts a failure that stops the run; returns the ranks of the trainer shards
        it left dead or stuck (they cannot write a checkpoint). A reference or critic
        worker of its own that died (``RoleFailed``) leaves every shard alive: they
        write the checkpoint (with the critic's state, if a critic worker still lives)."""
        faults = all_errors(group, TrainerFailed)
        for fault in faults:
            self.totals.out_of_memory += fault.out_of_memory
            self.totals.timeouts += fault.timed_out
        self.totals.timeouts += sum(role.timed_out for role in all_errors(group, RoleFailed))
        self.totals.timeouts += isinstance(failure, WaitTimedOut)
        return {fault.rank for fault in faults if fault.dead}

    def unexpected(self, error: Exception, run_dir: Path) -> RunFailed:
        """An error no rule expected (a bug, a broken disk): its traceback goes to
        RUN_DIR/error.log and the run stops like any failure, with one line."""
        log = run_dir / ERROR_LOG
        log.write_text("".join(traceback.format_exception(error)))
        return RunFailed(f"unexpected {first_line(error)} (traceback in {log})")

    def message(self, failure: Exception, saved: str) -> str:
        """The one line a failed run ends with: why, what was saved, the failure counts."""
        failures = describe_failures(self.totals.failures())
        return f"{failure}; {saved}" + (f" [failures: {failures}]" if failures else "")
