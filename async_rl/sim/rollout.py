"""The simulated rollout side behind the orchestrator's protocols
(``async_rl.control.protocols``).

Owns: ``SimRollout`` (a ``RolloutClient`` over a ``SimEngine``: a group's lengths from
the length law, its rewards drawn with ``simulate.reward_p``, the reward latency after
its last sample; on lent devices, a request their return ended resumes on a standing
engine, ``fallback``'s, with the tokens it made: a prefill of them, then the rest), what
a simulated group's token reference holds (``SimTokens``: its lengths, all a trainer
shard costs) and ``SimEvaluator`` (run.eval_on = "idle_cpu": it takes only idle cores,
so it costs the run nothing). Every timing is on the virtual clock.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio
import msgspec

from async_rl.config import Config
from async_rl.sim.engine import SimEngine
from async_rl.sim.engine_calls import Request
from async_rl.sim.lengths import LengthLaw, prompt_tokens
from buffers.common.records import Group, Prompt
from buffers.common.reports import EvalResult, UsageReading
from workers.common.spans import Span

if TYPE_CHECKING:
    from async_rl.sim.preemption import Preemption

Clock = Callable[[], float]
"""The virtual clock every simulated worker reads."""


class SimTokens(msgspec.Struct, frozen=True, kw_only=True):
    """What a simulated group's token reference holds: its lengths (all a shard costs)."""

    prompt_length: int
    completion_lengths: tuple[int, ...]


class SimRollout:
    """One rollout worker: see the module docstring."""

    def __init__(self, rank: int, engine: SimEngine, config: Config, lengths: LengthLaw,
                 clock: Clock, preemption: Preemption | None = None,
                 fallback: Callable[[], SimEngine] | None = None) -> None:
        """``preemption``: told of every request (simulate.preemption_step); ``fallback``:
        the engine an aborted request runs again on (lent devices)."""
        self.rank, self.engine, self.config, self.lengths = rank, engine, config, lengths
        self.clock, self.preemption, self.fallback = clock, preemption, fallback
        self._call_s = engine.costs.hardware.call_s
        self._rng = random.Random()
        """Reseeded per group (cheaper than a new one): its rewards' draws."""

    @property
    def name(self) -> str:
        return f"rollout-{self.rank}"

    def _completions(self, prompt: Prompt, samples: int) -> tuple[int, ...]:
        cap = self.config.rollout.max_new_tokens
        return tuple(min(n, cap) for n in self.lengths.completions(prompt, samples))

    async def generate(self, prompt: Prompt) -> Group:
        cfg = self.config
        completions = self._completions(prompt, cfg.rollout.group_size)
        length = prompt_tokens(cfg, prompt)
        request = self.engine.submit(length, completions,
                                     after=cfg.simulate.reward_s + self._call_s)
        if self.preemption is not None:
            self.preemption.submitted((prompt.prompt_id, prompt.attempt), self.engine,
                                      self.rank, request)
        await request.done
        request = await self._again(request)
        rng = self._rng
        rng.seed(zlib.crc32(f"reward:{prompt.prompt_id}:{prompt.attempt}".encode()))
        cap = cfg.rollout.max_new_tokens
        return Group(
            prompt=prompt, prompt_length=length, completion_lengths=completions,
            rewards=tuple(float(rng.random() < cfg.simulate.reward_p) for _ in completions),
            finish_reasons=tuple("length" if n >= cap else "stop" for n in completions),
            min_version=request.min_version, max_version=request.max_version,
            num_tokens=sum(length + n for n in completions), rollout_rank=self.rank,
            finished_at=self.clock(),
            tokens=SimTokens(prompt_length=length, completion_lengths=completions))

    async def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        began = self.clock()
        requests: list[object] = []

        async def one(prompt: Prompt) -> None:
            requests.append(await self._again(await self.engine.generate(
                prompt_tokens(self.config, prompt), self._completions(prompt, 1),
                evaluate=True)))

        version = self.engine.version
        async with anyio.create_task_group() as group:
            for prompt in prompts:
                group.start_soon(one, prompt)
        return EvalResult(accuracy=self.config.simulate.reward_p, version_min=version,
                          version_max=self.engine.version, num_prompts=len(prompts),
                          rollout_rank=self.rank, seconds=self.clock() - began)

    async def _again(self, request: Request) -> Request:
        """``request``, or where its engine's devices left before it finished, its
        unfinished sequences resumed on the fallback engine (partial rollout's abort and
        resume): their prompt and the tokens they made (their mean) prefilled, then the
        tokens left; the versions span both engines'."""
        first = request.min_version
        while request.made is not None and self.fallback is not None:
            left = [(n - m, m) for n, m in zip(request.lengths, request.made, strict=True)
                    if n > m]
            request = await self.fallback().generate(
                request.prompt_tokens + round(sum(m for _, m in left) / len(left)),
                tuple(n for n, _ in left), evaluate=request.evaluate, after=request.after)
            first = min(first, request.min_version) if first >= 0 else request.min_version
        request.min_version = first
        return request

    async def version(self) -> int:
        return self.engine.version

    async def usage(self) -> UsageReading:
        return UsageReading(wall=self.clock(), cpu_s=self.engine.busy_s)

    async def spans(self) -> list[Span]:
        return self.engine.drain_spans()



class SimEvaluator:
    """run.eval_on = "idle_cpu": scores on cores the workers leave idle (no cost here)."""

    def __init__(self, reward_p: float) -> None:
        self.reward_p = reward_p

    async def evaluate(self, prompts: Sequence[Prompt], weights: object) -> EvalResult:
        version = weights.version  # type: ignore[attr-defined]
        return EvalResult(accuracy=self.reward_p, version_min=version, version_max=version,
                          num_prompts=len(prompts), rollout_rank=-1, seconds=0.0)
