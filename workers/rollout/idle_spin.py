"""Stopping an idle rollout engine's spin.

Owns: ``IdleSpin``, which, once a worker has nothing in flight, tells the engine's worker
process to block rather than spin until work arrives (``stop_spinning`` in
``workers.weights.vllm_extension`` says how). Without it an idle worker used a full
core: vLLM's queue reader spins for a second after every read, and steps or weight loads
come more often than that. Knows nothing about requests or weights beyond the ``busy``
test the worker hands it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from workers.rollout.config import RolloutConfig
from workers.rollout.engine import quiet_idle_reads

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


class IdleSpin:
    """One engine's idle-spin stops; ``failed`` says why the last one raised."""

    def __init__(self, busy: Callable[[], bool]) -> None:
        self._busy = busy
        """True while the engine has (or is about to get) work: no stop then."""
        self._engine: AsyncLLM | None = None
        """Set by ``start`` where the engine's executor spins (the CPU build's)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.failed: str | None = None

    async def start(self, engine: AsyncLLM, rollout: RolloutConfig) -> None:
        if await quiet_idle_reads(engine, rollout):
            self._engine = engine

    def soon(self) -> None:
        """Stops the spin if nothing is in flight. A task, so that the request that
        finished last returns without waiting for the rpc."""
        if self._engine is not None and not self._busy():
            task = asyncio.get_running_loop().create_task(self._stop())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _stop(self) -> None:
        await asyncio.sleep(0)  # work submitted in the same loop turn cancels it
        engine = self._engine
        if engine is None or self.failed or self._busy():
            return
        try:
            await engine.collective_rpc("stop_spinning")
        except Exception as err:
            if self._engine is not None:  # not a shutdown race
                self.failed = f"stopping the engine's idle spin failed: {err!r}"

    def close(self) -> None:
        self._engine = None
        for task in self._tasks:
            task.cancel()
