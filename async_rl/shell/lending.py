"""The rollout engines ``[autopilot]`` adds and removes in a real run.

Owns: ``RayLending``, the Ray shell's ``EngineLending``: ranks from rollout.num_workers
up to autopilot.max_rollout_workers, each with a bundle of its own held from the start
(``async_rl.shell.launch``: the roster's ``lendable`` entries, their cores the spare
ones first, then the trainer's). Adding rank r starts a rollout actor as a lost worker's
restart does (``restart_rollout``): from the trainer's current policy, written for it
under the step lock (``TrainerPolicy.written_for``: exactly the version it is labelled
with), then a member of trainer shard 0's weight group, so every later version reaches
it; ``LiveTuning`` then hands it to the pool. Removing rank r (out of the pool already:
no prompt goes to it) is the engine's clean stop: it hands its rollouts in progress
back (the actor's ``leave``: each comes back as a partial group, the ledger's
"handed_back" event with reason "engine_stopped", and another engine continues it from
its kept tokens), the removal waits for its calls in progress to end (within
run.call_timeout_s), then its engine is shut down. A call that fails instead (the
hand-back did not reach it) fails with the reason ``LEAVING`` and its prompt is
re-queued as a dead worker's is (the ledger's "failed" event, ``rollout_error:`` and
that reason). The actor itself is parked, not killed: it owns the tokens of the groups
it generated that wait in the queue, which a shard fetches when it trains them; it is
killed when its rank is added again (``restart_rollout``) or at the run's end. The
weight group is rebuilt without it at the next delivery (a delivery goes to the pool's
live ranks only). Each add and removal goes into the run's worker registry: one
console line (``async_rl.roster.registry_line``) and workers.json written again, the
engine's row marked added (and removed) after its step. A resumed run's engines the
autopilot had added start with the run (``async_rl.roster.resumed_engines``); they are
adopted here, to be removed as any added one. Knows nothing about when engines move
(``async_rl.control.autopilot``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import msgspec
import ray

from async_rl.config import Config
from async_rl.control.protocols import RolloutClient
from async_rl.control.rollout_pool import CurrentPolicy
from async_rl.roster import registry_line
from async_rl.shell.adapted_workers import restart_rollout
from async_rl.shell.adapters import RayRollout, RayTrainer
from async_rl.shell.launch import StartedWorkers
from buffers.common.partials import PartialGroup
from buffers.common.records import Group, Prompt
from buffers.common.reports import EvalResult, UsageReading
from workers.common.spans import SessionSpan, Span
from workers.layout import WorkerIdentity

log = logging.getLogger(__name__)

LEAVING = "engine removed by the autopilot"
"""Why a removed engine's calls in flight failed (the ledger's re-queue reason)."""


class _Lent:
    """An added engine's client: the worker, with its calls in progress counted (a
    removal waits for them to hand their rollouts back)."""

    def __init__(self, worker: RayRollout) -> None:
        self.worker = worker
        self.calls = 0
        self._idle = anyio.Event()
        self._idle.set()

    @property
    def name(self) -> str:
        return self.worker.name

    async def usage(self) -> UsageReading:
        return await self.worker.usage()

    async def spans(self) -> list[Span]:
        return await self.worker.spans()

    async def sessions(self) -> list[SessionSpan]:
        return await self.worker.sessions()

    async def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        return await self.worker.evaluate(prompts)

    async def version(self) -> int:
        return await self.worker.version()

    async def hand_back(self) -> int:
        return await self.worker.hand_back()

    async def generate(self, prompt: Prompt) -> Group | PartialGroup:
        return await self._counted(self.worker.generate(prompt))

    async def continue_group(self, partial: PartialGroup) -> Group | PartialGroup:
        return await self._counted(self.worker.continue_group(partial))

    async def _counted(self, call: Awaitable[Group | PartialGroup]) -> Group | PartialGroup:
        if not self.calls:
            self._idle = anyio.Event()
        self.calls += 1
        try:
            return await call
        finally:
            self.calls -= 1
            if not self.calls:
                self._idle.set()

    async def drained(self) -> None:
        """Returns once no call is in progress."""
        await self._idle.wait()


class RayLending:
    """See the module docstring. As ``EngineLending``: ``engines``,
    ``devices_per_engine``, ``trainer_devices``, ``add``, ``remove``."""

    def __init__(self, config: Config, started: StartedWorkers, source: RayTrainer,
                 registry: Callable[[Sequence[WorkerIdentity]], None] = lambda _: None
                 ) -> None:
        """``source``: trainer shard 0, whose weight group an added engine joins;
        ``registry``: writes the run's worker registry (workers.json), called with every
        worker that ran so far after each add and removal."""
        first = config.rollout.num_workers
        self.engines = (first, first + config.lendable_engines)
        gpus = ray.cluster_resources().get("GPU", 0)
        self.devices_per_engine = 1 if gpus else config.rollout.cpus_per_worker
        self.trainer_devices = 0
        """Spare devices: the trainer keeps its own (on CPU an added engine may share a
        trainer shard's cores; the autopilot's judgement of the move measures that)."""
        self.config, self.started, self.source = config, started, source
        self.current_policy: CurrentPolicy | None = None
        self.version: Callable[[], int] = lambda: 0
        """The policy version now: the steps trained (a removal's step)."""
        self.added: dict[int, _Lent] = {}
        self.registry = list(started.identities)
        """Every worker that ran, the engines added and removed included."""
        self._write_registry = registry

    def attach(self, current_policy: CurrentPolicy, version: Callable[[], int]) -> None:
        """The run's policy, as the orchestrator writes it for an engine to start from,
        and its version now."""
        self.current_policy, self.version = current_policy, version

    def adopt(self, rank: int, worker: RolloutClient) -> RolloutClient:
        """A resumed run's engine the autopilot had added, started with the run: its
        client, counted as an added engine's (to be removed as one)."""
        assert isinstance(worker, RayRollout)
        self.added[rank] = lent = _Lent(worker)
        return lent

    def _registered(self, identity: WorkerIdentity) -> None:
        log.info("%s", registry_line(identity))
        self._write_registry(self.registry)

    async def add(self, rank: int) -> RolloutClient:
        assert self.current_policy is not None, "attach() the run's policy first"
        model_dir, version = await self.current_policy(rank)
        model = msgspec.structs.replace(self.config.model, path=model_dir)
        worker = await restart_rollout(self.started, self.source, rank, model, version,
                                       self.config)
        self.added[rank] = lent = _Lent(worker)
        identity = msgspec.structs.replace(self.started.lendable[rank], pid=worker.pid,
                                           added_after_step=version)
        self.registry.append(identity)
        self._registered(identity)
        return lent

    async def remove(self, rank: int) -> None:
        try:
            await self._stop(rank)
        finally:  # in the registry as removed, whether it stopped cleanly or was lost
            self._unregister(rank)

    async def _stop(self, rank: int) -> None:
        lent = self.added.pop(rank, None)
        handle: Any = self.started.rollout.get(rank)
        if lent is None or handle is None:
            return  # lost meanwhile (its restart, if any, is the pool's)
        lent.worker.leaving = LEAVING
        handed = 0
        with anyio.move_on_after(self.config.run.call_timeout_s):
            with contextlib.suppress(ray.exceptions.RayError):
                handed = await handle.leave.remote()
            await lent.drained()
        with anyio.move_on_after(self.config.run.call_timeout_s), contextlib.suppress(
                ray.exceptions.RayError):
            await handle.shutdown.remote()
        log.info("rollout-%d removed: %d rollout(s) in progress handed back", rank, handed)

    def _unregister(self, rank: int) -> None:
        name, step = f"rollout-{rank}", self.version()
        for index in reversed(range(len(self.registry))):  # its latest row: still running
            row = self.registry[index]
            if row.name == name and row.removed_after_step < 0:
                self.registry[index] = row = msgspec.structs.replace(
                    row, removed_after_step=step)
                self._registered(row)
                break
