"""Reading what the live workers measured: usage counters, spans, sessions, versions.

Owns: ``WorkerReadings``, the orchestrator's reads of every live worker at the edges of
the training window (CPU-time and NVML counters for the cross-check, spans for idle
accounting, the rollout workers' agent sessions for the trace, the versions the engines
end on). A rollout worker found lost while being read is retired and left out, its
figures with it, as during training; trainer shards are read as they are (a lost shard
has already failed the run). Knows nothing about the run's loops or what the readings
mean. The reference's and critic's workers of their
own are read as trainer shards are.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from async_rl.control.failures import RolloutFailed
from async_rl.control.protocols import (
    CriticClient,
    ObservedWorker,
    ReferenceClient,
    RolloutClient,
    TracesSessions,
    TrainerClient,
)
from async_rl.control.rollout_pool import RolloutPool
from async_rl.control.run_health import RunHealth
from buffers.common.reports import UsageReading
from workers.common.spans import SessionSpan, Span

T = TypeVar("T")


class WorkerReadings:
    """See the module docstring."""

    def __init__(self, pool: RolloutPool, trainers: Sequence[TrainerClient],
                 health: RunHealth, roles: Sequence[ReferenceClient | CriticClient] = ()
                 ) -> None:
        """``roles``: the reference's and the critic's workers of their own, read as
        trainer shards are."""
        self._pool, self._health = pool, health
        self._trainers: list[TrainerClient | ReferenceClient | CriticClient] = [*trainers,
                                                                                *roles]

    async def from_rollout(self, call: Callable[[RolloutClient], Awaitable[T]]
                           ) -> list[tuple[RolloutClient, T]]:
        """``call`` on every live rollout worker, with the worker it came from."""
        found: list[tuple[RolloutClient, T]] = []
        for rank, worker in self._pool.workers.items():
            try:
                found.append((worker, await call(worker)))
            except RolloutFailed as failed:
                self._health.rollout_failed(failed)
                if failed.worker_gone:
                    self._pool.retire(rank, worker, failed.reason)
        return found

    async def from_every(self, call: Callable[[ObservedWorker], Awaitable[T]]
                         ) -> dict[str, T]:
        """``call`` on every live rollout worker, trainer shard and role worker, by name."""
        rollout = {w.name: value for w, value in await self.from_rollout(call)}
        return rollout | {t.name: await call(t) for t in self._trainers}

    async def usage(self) -> dict[str, UsageReading]:
        """Each live worker's CPU-time (and NVML) counters, keyed by worker name."""
        return await self.from_every(lambda w: w.usage())

    async def usage_since(self, first: dict[str, UsageReading]) -> dict[str, Any]:
        """usage.json: each worker read at both ends of the window, with the cores a
        trainer shard computes with (the CPU-time check divides by them)."""
        last = await self.usage()
        cores = {t.name: await t.mean_cores() for t in self._trainers}
        return {name: {"first": first[name], "last": reading, "cores": cores.get(name, 1.0)}
                for name, reading in last.items() if name in first}

    async def spans(self) -> list[Span]:
        """Every live worker's recorded spans."""
        return [span for spans in (await self.from_every(lambda w: w.spans())).values()
                for span in spans]

    async def sessions(self) -> list[SessionSpan]:
        """The agent sessions every live rollout worker kept for the trace."""

        async def kept(worker: RolloutClient) -> list[SessionSpan]:
            return await worker.sessions() if isinstance(worker, TracesSessions) else []

        return [s for _, sessions in await self.from_rollout(kept) for s in sessions]

    async def rollout_versions(self) -> list[int]:
        """The policy version each live rollout engine runs."""
        return [version for _, version in await self.from_rollout(lambda w: w.version())]
