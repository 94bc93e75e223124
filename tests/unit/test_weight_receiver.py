"""The rollout engine's end of a weight update, against a fake engine (no vLLM, no Ray):
the order of engine calls, refusals, phase timing, failure, abandonment, and updates
given up with the weights untouched (interrupted or cancelled: the engine resumes on
its old version)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, Literal

import pytest

from workers.common.errors import RolloutWorkerError
from workers.weights.config import WeightsConfig
from workers.weights.receiver import (
    INTERRUPTED,
    StaleVersion,
    UpdateInterrupted,
    WeightReceiver,
)


class FakeEngine:
    """Records the AsyncLLM calls a receiver makes; ``fail_on`` makes one of them raise."""

    def __init__(self, fail_on: str = "", drain: asyncio.Event | None = None,
                 failure: str = "") -> None:
        """failure: the message of the error ``fail_on`` raises."""
        self.calls: list[str] = []
        self.fail_on, self.failure = fail_on, failure
        self.errored = False
        self.drain = drain
        self.engine_core = SimpleNamespace(pause_scheduler_async=self._pause)
        self.renderer = SimpleNamespace(clear_mm_cache_async=self._record("clear_mm_cache"))
        self.start_weight_update = self._record("start_weight_update")
        self.update_weights = self._record("update_weights")
        self.resume_generation = self._record("resume")

    def _record(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> None:
            self.calls.append(name)
            if name == self.fail_on:
                raise RuntimeError(self.failure or f"{name} broke")

        return call

    async def _pause(self, *, mode: str, clear_cache: bool) -> None:
        if mode == "wait" and self.drain is not None:
            await self.drain.wait()
        await self._record(f"pause:{mode}:{clear_cache}")()

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._record(f"finish:{weight_version}")()

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        await self._record(f"pause_generation:{mode}")()


def receiver(mode: Literal["in_flight", "drain"] = "in_flight",
             kv_policy: Literal["keep", "recompute"] = "keep"
             ) -> tuple[WeightReceiver, list[bool]]:
    """A receiver and the ``updating`` value at each of its change notices."""
    changes: list[bool] = []
    weights = WeightsConfig(update_mode=mode, kv_policy=kv_policy)
    made = WeightReceiver(3, weights,
                          on_change=lambda: changes.append(made.updating))
    return made, changes


def test_in_flight_update_pauses_keeping_requests_relabels_while_paused_then_resumes() -> None:
    weights, changes = receiver(kv_policy="recompute")
    engine: Any = FakeEngine()

    async def update() -> Any:
        await weights.start(engine, 1, None)
        assert weights.updating
        await weights.receive(engine, {})
        await weights.receive(engine, {})  # a second part: the session is open already
        return await weights.finish(engine)

    timing = asyncio.run(update())
    # The backend's session opens at the first part, not at the pause.
    assert engine.calls == ["clear_mm_cache", "pause:keep:True", "start_weight_update",
                            "update_weights", "update_weights", "finish:1", "resume"]
    assert weights.version == 1 and weights.updates == 1 and not weights.updating
    assert changes[0] is True and changes[-1] is False  # busy from before the pause
    assert (timing.version, timing.rollout_rank, timing.publish_s) == (1, 3, 0.0)
    assert min(timing.pause_s, timing.transfer_s, timing.load_s) >= 0.0


@pytest.mark.parametrize(("mode", "kv_policy", "pause"), [
    ("in_flight", "keep", ["pause:keep:False"]),
    ("in_flight", "recompute", ["clear_mm_cache", "pause:keep:True"]),
    ("drain", "keep", ["pause:wait:False"]),
    ("drain", "recompute", ["clear_mm_cache", "pause:wait:True"]),
])
def test_the_kv_policy_keeps_the_cache_or_drops_every_block_at_the_pause(
        mode: Literal["in_flight", "drain"], kv_policy: Literal["keep", "recompute"],
        pause: list[str]) -> None:
    """"recompute": vLLM preempts the running requests to drop their blocks (they
    rebuild them under the new weights); "keep": the pause leaves the cache alone."""
    weights, _ = receiver(mode, kv_policy)
    engine: Any = FakeEngine(drain=asyncio.Event())
    engine.drain.set()

    async def update() -> None:
        await weights.start(engine, 1, None)
        await weights.finish(engine)

    asyncio.run(update())
    assert engine.calls == [*pause, "finish:1", "resume"]


def test_drain_is_generation_until_the_running_requests_are_done() -> None:
    weights, changes = receiver(mode="in_flight")
    drained = asyncio.Event()
    engine: Any = FakeEngine(drain=drained)

    async def update() -> None:
        start = asyncio.create_task(weights.start(engine, 2, "drain"))
        await asyncio.sleep(0.01)
        assert not weights.updating and changes == []  # still generating
        drained.set()
        await start
        assert weights.updating
        await weights.finish(engine)

    asyncio.run(update())
    assert engine.calls[0] == "pause:wait:False"


def test_stale_and_overlapping_updates_are_refused_without_pausing() -> None:
    weights, _ = receiver()
    engine: Any = FakeEngine()

    async def updates() -> None:
        await weights.start(engine, 1, None)
        with pytest.raises(RolloutWorkerError, match="still under way"):
            await weights.start(engine, 2, None)
        await weights.finish(engine)
        calls = len(engine.calls)
        with pytest.raises(StaleVersion, match="not newer"):
            await weights.start(engine, 1, None)
        assert len(engine.calls) == calls
        with pytest.raises(RolloutWorkerError, match="no weight update started"):
            await weights.finish(engine)

    asyncio.run(updates())
    assert weights.failed is None and weights.version == 1


def test_a_failed_step_aborts_what_runs_and_fails_the_worker() -> None:
    weights, _ = receiver()
    engine: Any = FakeEngine(fail_on="finish:1")

    async def update() -> None:
        await weights.start(engine, 1, None)
        with pytest.raises(RolloutWorkerError, match="finishing weights v1 failed"):
            await weights.finish(engine)

    asyncio.run(update())
    assert engine.calls[-1] == "pause_generation:abort"
    assert weights.failed is not None and not weights.updating and weights.version == 0


def test_an_update_the_trainer_abandons_mid_drain_fails_the_worker() -> None:
    weights, _ = receiver()
    drained = asyncio.Event()
    engine: Any = FakeEngine(drain=drained)

    async def update() -> None:
        start = asyncio.create_task(weights.start(engine, 1, "drain"))
        await asyncio.sleep(0.01)
        await weights.abandon(engine, "start timed out")
        assert "pause_generation:abort" in engine.calls  # its requests end now
        drained.set()
        with pytest.raises(RolloutWorkerError, match="abandoned by the trainer"):
            await start

    asyncio.run(update())
    assert "start_weight_update" not in engine.calls
    assert weights.failed is not None and not weights.updating


def test_an_interrupted_transfer_resumes_on_the_old_weights_and_takes_the_next_update(
) -> None:
    weights, changes = receiver()
    engine: Any = FakeEngine(fail_on="update_weights", failure=f"{INTERRUPTED}: peer gone")

    async def updates() -> None:
        await weights.start(engine, 1, None)
        with pytest.raises(UpdateInterrupted, match="weights v1 not applied, v0 kept"):
            await weights.receive(engine, {})
        assert not weights.updating and weights.failed is None
        engine.fail_on = ""
        await weights.start(engine, 1, None)  # the same version again, over a new group
        await weights.receive(engine, {})
        await weights.finish(engine)

    asyncio.run(updates())
    assert engine.calls == ["pause:keep:False", "start_weight_update", "update_weights",
                            "resume", "pause:keep:False", "start_weight_update",
                            "update_weights", "finish:1", "resume"]
    assert weights.version == 1 and weights.updates == 1 and weights.failed is None
    # Paused, resumed, paused again, resumed (phase changes notify too, within a pause).
    assert [c for i, c in enumerate(changes) if i == 0 or c != changes[i - 1]] == [
        True, False, True, False]


def test_a_transfer_that_fails_otherwise_fails_the_worker() -> None:
    weights, _ = receiver()
    engine: Any = FakeEngine(fail_on="update_weights", failure="engine core died")

    async def update() -> None:
        await weights.start(engine, 1, None)
        with pytest.raises(RolloutWorkerError, match="loading weights v1 failed") as err:
            await weights.receive(engine, {})
        assert not isinstance(err.value, UpdateInterrupted)

    asyncio.run(update())
    assert engine.calls[-1] == "pause_generation:abort"
    assert weights.failed is not None and weights.version == 0


def test_a_cancelled_update_resumes_without_opening_a_session() -> None:
    weights, _ = receiver()
    engine: Any = FakeEngine()

    async def updates() -> None:
        await weights.cancel(engine)  # nothing started: nothing to do
        await weights.start(engine, 1, None)
        await weights.cancel(engine)
        await weights.start(engine, 1, None)
        await weights.receive(engine, {})
        await weights.finish(engine)

    asyncio.run(updates())
    assert engine.calls == ["pause:keep:False", "resume", "pause:keep:False",
                            "start_weight_update", "update_weights", "finish:1", "resume"]
    assert weights.version == 1 and weights.failed is None


def test_the_pause_is_told_apart_by_phase_wire_then_load() -> None:
    seen: list[tuple[bool, str]] = []
    made = WeightReceiver(0, WeightsConfig(),
                          on_change=lambda: seen.append((made.updating, made.phase)))
    engine: Any = FakeEngine()

    async def update() -> None:
        await made.start(engine, 1, None)
        await made.receive(engine, {})
        await made.finish(engine)

    asyncio.run(update())
    assert seen == [(True, ""), (True, "wire"), (True, ""), (True, "load"), (False, "")]


def test_a_transfer_into_an_engine_that_died_fails_at_once_not_at_the_deadline() -> None:
    weights, _ = receiver()
    engine: Any = FakeEngine()
    hang = asyncio.Event()

    async def update_weights(*args: Any) -> None:
        engine.calls.append("update_weights")
        engine.errored = True  # the engine process is gone: this call never returns
        await hang.wait()

    engine.update_weights = update_weights

    async def update() -> float:
        await weights.start(engine, 1, None)
        began = time.monotonic()
        with pytest.raises(RolloutWorkerError, match="engine process died"):
            await weights.receive(engine, {})
        return time.monotonic() - began

    assert asyncio.run(update()) < 5
    assert weights.failed is not None and weights.version == 0
