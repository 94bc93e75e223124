"""The rollout engines ``[autopilot]`` adds and removes in a real run.

Owns: ``RayLending``, the Ray shell's ``EngineLending``: ranks from rollout.num_workers
up to autopilot.max_rollout_workers, each with a bundle of its own held from the start
(``async_rl.shell.launch``: the roster's ``lendable`` entries, their cores the spare
ones first, then the trainer's). Adding rank r starts a rollout actor as a lost worker's
restart does (``restart_rollout``): from the trainer's current policy, written for it
under the step lock (``TrainerPolicy.written_for``: exactly the version it is labelled
with), then a member of trainer shard 0's weight group, so every later version reaches
it; ``LiveTuning`` then hands it to the pool. Removing rank r (out of the pool already:
no prompt goes to it) stops its actor: its calls in flight fail with the reason
``LEAVING``, and their prompts are re-queued as a dead worker's are (the ledger's
"failed" event with ``rollout_error:`` and that reason; the group of such a call is
never queued, so nothing is trained twice); then its engine is shut down and the actor
killed, its bundle kept for the next add. The weight group is rebuilt without it at the
next delivery (a delivery goes to the pool's live ranks only). Knows nothing about when
engines move (``async_rl.control.autopilot``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import anyio
import msgspec
import ray

from async_rl.config import Config
from async_rl.control.protocols import RolloutClient
from async_rl.control.rollout_pool import CurrentPolicy
from async_rl.shell.adapters import RayRollout, RayTrainer, restart_rollout
from async_rl.shell.launch import StartedWorkers

log = logging.getLogger(__name__)

LEAVING = "engine removed by the autopilot"
"""Why a removed engine's calls in flight failed (the ledger's re-queue reason)."""


class RayLending:
    """See the module docstring. As ``EngineLending``: ``engines``,
    ``devices_per_engine``, ``trainer_devices``, ``add``, ``remove``."""

    def __init__(self, config: Config, started: StartedWorkers, source: RayTrainer) -> None:
        """``source``: trainer shard 0, whose weight group an added engine joins."""
        first = config.rollout.num_workers
        self.engines = (first, first + config.lendable_engines)
        gpus = ray.cluster_resources().get("GPU", 0)
        self.devices_per_engine = 1 if gpus else config.rollout.cpus_per_worker
        self.trainer_devices = 0
        """Spare devices: the trainer keeps its own (on CPU an added engine may share a
        trainer shard's cores; the autopilot's judgement of the move measures that)."""
        self.config, self.started, self.source = config, started, source
        self.current_policy: CurrentPolicy | None = None
        self.added: dict[int, RayRollout] = {}

    def attach(self, current_policy: CurrentPolicy) -> None:
        """The run's policy, as the orchestrator writes it for an engine to start from."""
        self.current_policy = current_policy

    async def add(self, rank: int) -> RolloutClient:
        assert self.current_policy is not None, "attach() the run's policy first"
        model_dir, version = await self.current_policy(rank)
        model = msgspec.structs.replace(self.config.model, path=model_dir)
        worker = await restart_rollout(self.started, self.source, rank, model, version,
                                       self.config)
        self.added[rank] = worker
        log.info("rollout-%d added at version %d", rank, version)
        return worker

    async def remove(self, rank: int) -> None:
        worker = self.added.pop(rank, None)
        handle: Any = self.started.rollout.pop(rank, None)
        if worker is not None:
            worker.leaving = LEAVING
        if handle is None:
            return  # lost meanwhile (its restart, if any, is the pool's)
        with anyio.move_on_after(self.config.run.call_timeout_s), contextlib.suppress(
                ray.exceptions.RayError):
            await handle.shutdown.remote()
        ray.kill(handle)
        log.info("rollout-%d removed: its prompts in flight are re-queued", rank)
