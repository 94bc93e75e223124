"""What a stop at a given step would cost a simulated run (simulate.preemption_step).

Owns: ``Preemption`` (every rollout request of the run, by prompt attempt and engine, and
the count it takes at the end of simulate.preemption_step: ``StopCost``) and
``ProbedOrchestrator`` (the real orchestrator, which hands the probe its state at the
instant a checkpoint of that step would be taken: after the step's update, publish and
record). The count follows what a clean stop keeps (docs/operations.md): the replay
queue's groups, with their tokens, go back in the queue on resume through the staleness
rule at the checkpoint's version; a rollout in flight is handed back with the tokens it
has and continued from them on resume (a multi-turn one, with an environment or an
agent, restarts: it is lost); every other prompt admitted and not trained (finished and
waiting for its reward or for queue room, re-queued) is owed and generated again from
scratch. Tokens are completion tokens (what decoding costs); seconds are those tokens
at the run's mean generation rate until the stop, all engines together.
Nothing is changed: the simulated run goes on as without the probe. Knows nothing about
how the engines cost their steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio.abc

from async_rl.analysis.results import StopCost
from async_rl.control.orchestrator import Orchestrator

if TYPE_CHECKING:
    from async_rl.config import Config
    from async_rl.control.protocols import Workers
    from async_rl.run.run_dir import RunWriter
    from async_rl.sim.engine import SimEngine
    from async_rl.sim.engine_calls import Request
    from async_rl.sim.rollout import Clock
    from async_rl.tasks.sources import PromptSource
    from buffers.common.records import Prompt


class Preemption:
    """See the module docstring. ``step``: simulate.preemption_step (> 0)."""

    def __init__(self, step: int, clock: Clock, hands_back: bool = True) -> None:
        """``hands_back``: a stop keeps the rollouts in flight (single-turn tasks); False:
        they restart (multi-turn)."""
        self.step, self.clock, self.hands_back = step, clock, hands_back
        self.requests: dict[tuple[str, int], tuple[SimEngine, int, Request]] = {}
        """(prompt id, attempt) -> its engine, that engine's rank, its request."""
        self.first = math.inf
        """When the first rollout request was made."""
        self.cost: StopCost | None = None
        """The count, once taken."""

    def submitted(self, key: tuple[str, int], engine: SimEngine, rank: int,
                  request: Request) -> None:
        """A rollout request was made for prompt attempt ``key``."""
        self.first = min(self.first, self.clock())
        self.requests[key] = (engine, rank, request)

    def tokens(self, key: tuple[str, int]) -> int:
        """Completion tokens generated so far for ``key`` (0: not yet started)."""
        if key not in self.requests:
            return 0
        engine, _, request = self.requests[key]
        if request.max_version >= 0:  # completed: every sample's tokens
            return sum(request.lengths)
        if request.min_version < 0:  # still waiting to join its engine's batch
            return 0
        decoded = engine.step_now() - (request.finish - max(request.lengths))
        return sum(min(length, max(decoded, 0)) for length in request.lengths)

    def in_flight(self, key: tuple[str, int]) -> bool:
        """Whether ``key``'s request is decoding now (joined its batch, not finished)."""
        request = self.requests[key][2] if key in self.requests else None
        return request is not None and request.min_version >= 0 > request.max_version

    def take(self, orchestrator: Orchestrator, engines: int) -> StopCost:
        """The count at this instant (see the module docstring); ``engines``:
        rollout.num_workers."""
        queue = orchestrator.queue
        version, bound = orchestrator.version, queue.max_staleness
        kept = queue.snapshot().items
        kept_keys = {(g.prompt.prompt_id, g.prompt.attempt) for g in kept}
        stale = [g for g in kept if version - g.min_version > bound]
        owed = [(p.prompt_id, p.attempt) for p in orchestrator.prompts.owed()]
        owed = [key for key in owed if key not in kept_keys]
        owed_tokens = {key: self.tokens(key) for key in owed}
        per_engine = [0] * engines
        for key, tokens in owed_tokens.items():
            if key in self.requests:
                per_engine[self.requests[key][1]] += tokens
        handed = {key: tokens for key, tokens in owed_tokens.items()
                  if self.hands_back and tokens and self.in_flight(key)}
        lost_tokens = {key: tokens for key, tokens in owed_tokens.items()
                       if key not in handed}
        generated = sum(self.tokens(key) for key in self.requests)
        kept_tokens = sum(self.tokens(key) for key in kept_keys)
        handed_back = sum(handed.values())
        lost = sum(lost_tokens.values())
        elapsed = self.clock() - self.first if self.requests else 0.0
        rate = generated / elapsed if elapsed > 0 else 0.0

        def seconds(tokens: int) -> float:
            return tokens / rate if rate else 0.0

        return StopCost(
            step=self.step, version=version, at_s=self.clock(),
            generated_tokens=generated, tokens_per_s=rate,
            kept_groups=len(kept), kept_tokens=kept_tokens, kept_s=seconds(kept_tokens),
            stale_groups=len(stale),
            stale_tokens=sum(self.tokens((g.prompt.prompt_id, g.prompt.attempt))
                             for g in stale),
            owed_prompts=len(owed),
            handed_back_rollouts=len(handed), handed_back_tokens=handed_back,
            handed_back_s=seconds(handed_back),
            lost_rollouts=sum(1 for tokens in lost_tokens.values() if tokens),
            lost_tokens=lost, lost_s=seconds(lost),
            done_tokens=generated - kept_tokens - handed_back - lost,
            engine_lost_tokens=tuple(per_engine))


class ProbedOrchestrator(Orchestrator):
    """The real orchestrator, counted by ``probe`` at the end of its step (its other
    behaviour unchanged)."""

    def __init__(self, probe: Preemption, config: Config, out: RunWriter,
                 source: PromptSource, eval_prompts: Sequence[Prompt], workers: Workers,
                 clock: Clock) -> None:
        super().__init__(config, out, source, eval_prompts, workers, clock=clock)
        self.probe = probe

    async def _checkpoint_if_due(self, step: int, beside: anyio.abc.TaskGroup) -> None:
        await super()._checkpoint_if_due(step, beside)
        if step == self.probe.step and self.probe.cost is None:
            self.probe.cost = self.probe.take(self, self.config.rollout.num_workers)
