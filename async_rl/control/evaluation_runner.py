"""EvaluationRunner: running the held-out evaluations, on a rollout engine or the evaluator.

Owns: the evaluations at the start and end of a run, and those due during training
(``EvalLog.due``) one at a time beside it; each is one row of eval.jsonl. Where they run
is run.eval_on's: on a live rollout worker's engine (due once a version is delivered;
a rollout worker lost during an evaluation is retired, ``RolloutPool`` replaces it, and
the evaluation runs again on a live one), or on the ``Evaluator`` with trainer shard 0's
weights of exactly the due version (taken the moment it is trained). Any other failure
costs only that row. Knows nothing about when evaluations fall due
(``async_rl.control.evaluation``) or about training.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio

from async_rl.control.evaluation import EvalLog, describe
from async_rl.control.failures import EvaluationFailed, RolloutFailed
from async_rl.control.protocols import Evaluator, PolicyWeights, TrainerClient
from async_rl.control.rollout_pool import RolloutPool
from async_rl.control.run_health import RunHealth
from async_rl.run.run_dir import RunWriter
from async_rl.run.summary import EvalPoint
from buffers.common.records import Prompt
from buffers.common.reports import EvalResult

log = logging.getLogger(__name__)


class EvaluationRunner:
    """See the module docstring. ``evaluator`` None: evaluations run on rollout workers."""

    def __init__(self, prompts: Sequence[Prompt], evals: EvalLog, pool: RolloutPool,
                 health: RunHealth, out: RunWriter, *, evaluator: Evaluator | None = None,
                 source: TrainerClient | None = None) -> None:
        if evaluator is not None and source is None:
            raise ValueError("an evaluator needs the trainer shard its weights come from")
        self.prompts = tuple(prompts)
        self.evals, self.pool, self.health, self.out = evals, pool, health, out
        self.evaluator, self.source = evaluator, source
        self.over = anyio.Event()
        """Set once training ended and every evaluation due during it has run."""

    # The orchestrator says when a version exists and when the engines run it; which of
    # the two makes an evaluation due depends on where it runs.

    async def version_trained(self, version: int) -> None:
        """Training just produced ``version`` (before the next step starts): with an
        evaluator, takes its weights now if its evaluation is due."""
        if self.evaluator is not None and (step := self._due(version)) is not None:
            weights = await self._weights(version)
            self.evals.queue(step, weights)

    def version_delivered(self, version: int) -> None:
        """Every rollout engine runs ``version`` now: due on the rollout workers."""
        if self.evaluator is None and (step := self._due(version)) is not None:
            self.evals.queue(step)

    def _due(self, version: int) -> int | None:
        """The step ``version``'s evaluation stands for; never one without prompts."""
        return self.evals.due(version) if self.prompts else None

    async def due_loop(self) -> None:
        """Runs the evaluations due during training one at a time, until training ends."""
        async with self.evals.due_steps:
            async for step, weights in self.evals.due_steps:
                await self._evaluate(step, weights)
        self.over.set()

    async def evaluate(self, step: int, version: int) -> EvalPoint | None:
        """Evaluates the policy of ``version`` now (no step is training); None if it
        failed."""
        if not self.prompts:
            return None
        weights = await self._weights(version) if self.evaluator is not None else None
        return await self._evaluate(step, weights)

    async def _weights(self, version: int) -> PolicyWeights:
        assert self.source is not None
        return await self.source.policy_weights(version)

    async def _evaluate(self, step: int, weights: PolicyWeights | None) -> EvalPoint | None:
        if self.evaluator is not None:
            assert weights is not None
            try:
                result = await self.evaluator.evaluate(self.prompts, weights)
            except EvaluationFailed as failed:
                log.warning("evaluation at step %d failed: %s", step, failed)
                return None
        elif (found := await self._on_rollout(step)) is not None:
            result = found
        else:
            return None
        point = self.evals.record(step, result)
        self.out.eval(point)
        log.info("%s", describe(point))
        return point

    async def _on_rollout(self, step: int) -> EvalResult | None:
        """Greedy held-out accuracy on a live rollout worker; None if it failed."""
        for attempt in (1, 2):
            rank, worker = await self.pool.any_live()
            try:
                return await worker.evaluate(self.prompts)
            except RolloutFailed as failed:
                self.health.rollout_failed(failed)
                if failed.worker_gone:
                    self.pool.retire(rank, worker, failed.reason)
                if not failed.worker_gone or attempt == 2:
                    log.warning("evaluation at step %d failed: %s", step, failed.reason)
                    return None
        return None
