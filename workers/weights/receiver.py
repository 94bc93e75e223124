"""A rollout engine's end of a weight update: pause, take the weights in through vLLM's
weight-transfer API, relabel, resume.

Owns: ``WeightReceiver``, the steps the trainer's weight-transfer engine drives through
its ``VLLMWeightSyncClient`` calls (``connect``; then per update ``start``, ``receive``
one or more times, ``finish``); the update modes (``in_flight``: pause keeping running
requests; ``drain``: let them finish first); the engine's per-token version label,
changed while the engine is still paused so no token is sampled between the load and its
label; the phase timing; and failure. A transfer that the backend reports as
``INTERRUPTED`` (the gloo backend stages a whole version before loading any of it, so a
broken broadcast leaves the weights as they were) and an update the trainer ``cancel``s
before its transfer resume the engine on its old weights, whole: the version is applied
whole or not at all, and the worker goes on serving. Any other failed step may leave
the weights half old, half new, so it aborts what is running and the worker refuses
further work.

Knows nothing about transports (the engine's weight-transfer backend moves the bytes) or
spans (the rollout worker is told through ``on_change``). vLLM is imported inside the
methods, so importing this module stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from buffers.common.reports import BroadcastTiming
from workers.common.errors import RolloutWorkerError
from workers.weights.config import UpdateMode, WeightsConfig

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

INTERRUPTED = "weight transfer interrupted before any weight was loaded"
"""How a backend's receive says it failed leaving the model untouched (the message of
the error it raises starts with it: it crosses vLLM's process boundary as text)."""


Phase = Literal["", "wire", "load"]


DEAD_POLL_S = 0.5
"""How often a transfer or load looks whether the engine died under it."""


async def _unless_dead(engine: AsyncLLM, call: Awaitable[None]) -> None:
    """Awaits ``call``, failing as soon as the engine is found dead: vLLM's calls into a
    dead engine process may never return, and the broadcast's other members wait on this
    worker's answer to be told apart from it."""
    task = asyncio.ensure_future(call)
    try:
        while not (await asyncio.wait({task}, timeout=DEAD_POLL_S))[0]:
            if engine.errored:
                raise RuntimeError("the vLLM engine process died")
        task.result()
    finally:
        task.cancel()


class StaleVersion(ValueError):
    """An update to a version the engine already has (or a newer one): refused before
    pausing, nothing changed (a worker restarted from a newer policy than the one
    being delivered)."""


class UpdateInterrupted(RolloutWorkerError):
    """The update failed before anything was loaded: the engine runs its old weights,
    whole, and takes the next update."""


class WeightReceiver:
    """The weights one rollout engine runs, and how new ones get in; see the module
    docstring. Steps run one at a time per update; a second ``start`` before ``finish``
    is refused (interleaved updates would resume the engine in the middle of a load)."""

    def __init__(self, rank: int, weights: WeightsConfig, *,
                 on_change: Callable[[], None], version: int = 0) -> None:
        """on_change: called whenever ``updating``, ``phase`` or ``version`` changes.
        version: that of the weights the engine starts with. weights.kv_policy
        "recompute" drops every KV block at each pause (``start``)."""
        self._rank, self._mode = rank, weights.update_mode
        self._clear_cache = weights.kv_policy == "recompute"
        self._on_change = on_change
        self.version = version
        """Policy version of the weights in the engine (the label on its tokens)."""
        self.updating = False
        """The engine is paused for an update (in drain mode: once the drain is done)."""
        self.phase: Phase = ""
        """Of the pause: "wire" while the backend receives, "load" while the version goes
        into the model, "" between (waiting on the group, the trainer's calls)."""
        self.failed: str | None = None
        """Why the engine's weights cannot be trusted any more; None while they can."""
        self.updates = 0
        self._pending: int | None = None  # the version started and not yet finished
        self._receiving = False  # the backend's session of the pending update is open
        self._began = self._paused = self._transfer_s = 0.0

    async def connect(self, engine: AsyncLLM, init_info: dict[str, Any]) -> None:
        """Joins the trainer's transfer (the backend's handshake, e.g. a process group;
        again whenever the trainer rebuilds it)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        try:
            await engine.init_weight_transfer_engine(
                WeightTransferInitRequest(init_info=init_info))
        except Exception as err:
            if INTERRUPTED in str(err):  # another member did not join: try again later
                raise UpdateInterrupted(f"rollout worker {self._rank}: {err}") from err
            raise

    async def start(self, engine: AsyncLLM, version: int, mode: UpdateMode | None) -> None:
        """Pauses the engine for ``version`` and prepares its model to receive.

        ``in_flight``: running requests stay in the engine and continue after the
        update (their later tokens carry the new version); ``drain``: no request starts
        and the running ones finish first. ``mode`` overrides ``weights.update_mode``.
        With weights.kv_policy "recompute" the pause also drops every cached block; vLLM
        does that by preempting the running requests, so they recompute their KV under
        the new weights when they resume ("keep": their KV stays as it was computed).
        """
        if self._pending is not None:
            raise RolloutWorkerError(f"rollout worker {self._rank}: update to version "
                                     f"{self._pending} is still under way")
        if version <= self.version:
            raise StaleVersion(f"rollout worker {self._rank}: version {version} is not newer "
                               f"than the loaded version {self.version}")
        self._pending, self._transfer_s, self._receiving = version, 0.0, False
        self._began = time.perf_counter()
        try:
            drain = (mode or self._mode) == "drain"
            if not drain:
                self._set_updating(True)
            # The engine core's pause itself: AsyncLLM.pause_generation adds a 20 ms sleep
            # (for tidier output ordering, not correctness) that would be most of an
            # update's pause here.
            if self._clear_cache:
                await engine.renderer.clear_mm_cache_async()
            await engine.engine_core.pause_scheduler_async(
                mode="wait" if drain else "keep", clear_cache=self._clear_cache)
            if self.failed is not None:  # abandoned by the trainer during the drain
                raise RolloutWorkerError(self.failed)
            if drain:  # the running requests were generating until now
                self._set_updating(True)
            self._paused = time.perf_counter()
        except Exception as err:
            await self._fail(engine, f"pausing for weights v{version}", err)

    async def receive(self, engine: AsyncLLM, update_info: dict[str, Any] | list[Any]) -> None:
        """Takes in one part of the update (the backend receives and loads it)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        version = self._started()
        began = time.perf_counter()
        try:
            # The backend's session opens here, not at the pause: an update cancelled
            # before its transfer then leaves no session open in the engine.
            if not self._receiving:
                self._receiving = True
                await _unless_dead(engine, engine.start_weight_update())
            self._set_phase("wire")
            await _unless_dead(engine, engine.update_weights(
                WeightTransferUpdateRequest(update_info=update_info)))
            self._set_phase("")
        except Exception as err:
            self.phase = ""
            if INTERRUPTED in str(err) and self.failed is None:
                await self._resume_untouched(engine)
                raise UpdateInterrupted(f"rollout worker {self._rank}: weights v{version} "
                                        f"not applied, v{self.version} kept: {err}") from err
            await self._fail(engine, f"loading weights v{version}", err)
        self._transfer_s += time.perf_counter() - began

    async def cancel(self, engine: AsyncLLM) -> None:
        """The trainer gave the update up before any byte of it was received (another
        member of the broadcast failed to pause): resumes on the old weights."""
        if self._pending is not None and self.failed is None:
            await self._resume_untouched(engine)

    async def _resume_untouched(self, engine: AsyncLLM) -> None:
        self._pending = None
        try:
            await engine.resume_generation()
        except Exception as err:
            await self._fail(engine, "resuming on the old weights", err)
        self._set_updating(False)

    async def finish(self, engine: AsyncLLM) -> BroadcastTiming:
        """Completes the load, relabels and resumes; the update's timing.

        Phases on this process's clock: ``pause_s`` until the engine was paused (the
        drain); then, while paused, ``transfer_s`` inside the backend's receive-and-load
        calls and ``load_s`` the rest (preparing and finishing the reload, the relabel,
        the resume and the gaps between the trainer's calls). The engine stood still for
        ``transfer_s + load_s``.
        """
        version = self._started()
        try:
            # Relabel before resuming: every token sampled after the load carries it.
            self._set_phase("load")
            await _unless_dead(engine, engine.finish_weight_update(weight_version=str(version)))
            self.version = version
            self.phase = ""
            await engine.resume_generation()
        except Exception as err:
            self.phase = ""
            await self._fail(engine, f"finishing weights v{version}", err)
        resumed = time.perf_counter()
        self._pending = None
        self.updates += 1
        self._set_updating(False)
        return BroadcastTiming(version=version, rollout_rank=self._rank, publish_s=0.0,
                               transfer_s=self._transfer_s,
                               pause_s=self._paused - self._began,
                               load_s=resumed - self._paused - self._transfer_s)

    def _started(self) -> int:
        if self._pending is None:
            raise RolloutWorkerError(f"rollout worker {self._rank}: no weight update started")
        return self._pending

    def _set_updating(self, updating: bool) -> None:
        self.updating = updating
        self._on_change()

    def _set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self._on_change()

    async def abandon(self, engine: AsyncLLM, reason: str) -> None:
        """The trainer gave up on the update (a step failed or timed out on its side):
        the weights may be half loaded, and the engine may stay paused waiting for steps
        that will not come. Fails the worker as a failed step does."""
        await self._give_up(engine, f"weight update abandoned by the trainer: {reason}")

    async def _give_up(self, engine: AsyncLLM, failure: str) -> None:
        # Nothing generated from here on can be trusted or labelled: abort what is
        # running (those calls raise, and their prompts go back to the controller) and
        # refuse further work; the controller retires the worker.
        self.failed = self.failed or failure
        self._set_updating(False)
        with contextlib.suppress(Exception):  # the engine itself may be what died
            await engine.pause_generation(mode="abort", clear_cache=False)

    async def _fail(self, engine: AsyncLLM, step: str, err: Exception) -> None:
        await self._give_up(engine, f"{step} failed: {err!r}")
        raise RolloutWorkerError(f"rollout worker {self._rank}: {self.failed}") from err
