"""The rollout worker's weight-update calls: what the trainer's weight-transfer engine
calls on each rollout actor to bring it a new policy version.

Owns: ``WeightUpdateCalls``, the base of ``workers.rollout.worker.RolloutWorker`` with
the calls vLLM's ``VLLMWeightSyncClient`` makes (``workers.weights.sender.EngineClient``:
join the broadcast group, start, receive, cancel, finish or abandon an update) and the
policy version they leave. Each hands the call to the worker's ``WeightReceiver``
(``workers.weights.receiver``), which does the work, with the engine the worker says is
ready (``ready()``: it raises once the worker failed or before its engine was built).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from buffers.common.reports import BroadcastTiming
from workers.weights.config import UpdateMode
from workers.weights.receiver import WeightReceiver

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


class WeightUpdateCalls:
    """See the module docstring. ``receiver``: the worker's; ``ready``: its engine, or
    why it cannot be used (raised); ``built``: its engine, None before it is built or
    after it shut down (an abandoned update fails a worker whatever its state)."""

    def __init__(self, receiver: WeightReceiver, *, ready: Callable[[], AsyncLLM],
                 built: Callable[[], AsyncLLM | None]) -> None:
        self._receiver = receiver
        self._ready_engine, self._built_engine = ready, built

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Joins the trainer's weight-broadcast group (again whenever the trainer rebuilds
        it: a member was lost or joined)."""
        await self._receiver.connect(self._ready_engine(), init_info)

    async def start_weight_update(self, version: int, mode: UpdateMode | None = None) -> None:
        """Pauses the engine to take in ``version`` (``mode`` overrides
        ``weights.update_mode`` for this update); ``WeightReceiver.start`` says how."""
        await self._receiver.start(self._ready_engine(), version, mode)

    async def update_weights(self, update_info: dict[str, Any] | list[Any]) -> None:
        """Receives (a part of) the started update."""
        await self._receiver.receive(self._ready_engine(), update_info)

    async def cancel_weight_update(self) -> None:
        """The trainer gave the started update up before its transfer: resume on the
        old weights (``WeightReceiver.cancel``)."""
        await self._receiver.cancel(self._ready_engine())

    async def finish_weight_update(self) -> BroadcastTiming:
        """Completes the update, relabels, resumes; its timing (publish_s left 0)."""
        return await self._receiver.finish(self._ready_engine())

    async def abandon_weight_update(self, reason: str) -> None:
        """The trainer gave up on the update under way: this worker fails (see
        ``WeightReceiver.abandon``)."""
        engine = self._built_engine()
        if engine is not None:
            await self._receiver.abandon(engine, reason)

    async def version(self) -> int:
        """Policy version of the weights now in the engine."""
        return self._receiver.version
