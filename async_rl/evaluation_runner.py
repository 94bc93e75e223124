"""EvaluationRunner: running the held-out evaluations on the rollout workers' engines.

Owns: the evaluations at the start and end of a run, and those due during training
(``EvalLog.due_steps``) one at a time beside it; each is one row of eval.jsonl. A
rollout worker lost during an evaluation is retired (``RolloutPool`` replaces it) and the
evaluation runs again on a live one; any other failure costs only that row. Knows
nothing about when evaluations fall due (``async_rl.evaluation``) or about training.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from async_rl.evaluation import EvalLog, describe
from async_rl.protocols import RolloutFailed
from async_rl.records import Prompt
from async_rl.rollout_pool import RolloutPool
from async_rl.run_dir import EvalPoint, RunWriter
from async_rl.run_health import RunHealth


class EvaluationRunner:
    """See the module docstring."""

    def __init__(self, prompts: Sequence[Prompt], evals: EvalLog, pool: RolloutPool,
                 health: RunHealth, out: RunWriter) -> None:
        self.prompts = tuple(prompts)
        self.evals, self.pool, self.health, self.out = evals, pool, health, out
        self.over = anyio.Event()
        """Set once training ended and every evaluation due during it has run."""

    async def due_loop(self) -> None:
        """Runs the evaluations due during training one at a time, until training ends."""
        async with self.evals.due_steps:
            async for step in self.evals.due_steps:
                await self.evaluate(step)
        self.over.set()

    async def evaluate(self, step: int) -> EvalPoint | None:
        """Greedy held-out accuracy on a live rollout worker; None if it failed."""
        if not self.prompts:
            return None
        for attempt in (1, 2):
            rank = await self.pool.any_live()
            worker = self.pool.workers[rank]
            try:
                result = await worker.evaluate(self.prompts)
            except RolloutFailed as failed:
                self.health.rollout_failed(failed)
                if failed.worker_gone:
                    self.pool.retire(rank, worker, failed.reason)
                if not failed.worker_gone or attempt == 2:
                    print(f"evaluation at step {step} failed: {failed.reason}")
                    return None
                continue
            point = self.evals.record(step, result)
            self.out.eval(point)
            print(describe(point))
            return point
        return None
