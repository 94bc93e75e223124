"""The Ray shell: starts Ray and the workers, adapts actor handles to the protocols, runs.

Owns: ``ray.init`` (or joining a cluster), creating the actors (through
``async_rl.shell.launch``) and handing them to the orchestrator as its protocols
(``async_rl.shell.adapters``), resuming from a checkpoint, stop signals, and shutting
everything down. The run's logic is ``async_rl.control.orchestrator``'s; nothing
here decides anything about it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import ray
from ray.util.placement_group import remove_placement_group

from async_rl.config import Config
from async_rl.control.checkpoint_files import (
    TRAINER,
    CheckpointError,
    check_backend,
    latest_checkpoint,
)
from async_rl.control.orchestrator import Orchestrator
from async_rl.control.protocols import (
    RunFailed,
    first_error,
)
from async_rl.run.run_dir import WORKERS_LOG, RunWriter
from async_rl.run.summary import RunSummary
from async_rl.shell.adapters import adapt
from async_rl.shell.launch import StartedWorkers, launch_workers, registry_table
from async_rl.shell.role_adapters import adapt_own_roles
from async_rl.shell.role_launch import own_roles
from async_rl.shell.worker_logs import ray_notices_to_log, ray_options
from async_rl.tasks.table import build_task, worker_task
from buffers.common.concurrent_calls import each
from buffers.common.config import ConfigError
from workers.rewards.callables import Reward

log = logging.getLogger(__name__)

NAMESPACE = "async-rl"
"""Ray namespace of a run's named actors ("rollout-0", "trainer-1", ...)."""


async def _shutdown(started: StartedWorkers) -> None:
    """Stops the engines and process groups, then the actors and their placement groups:
    on a cluster the shell joined, nothing of the run is left behind."""
    actors = [*started.rollout.values(), *started.trainers, *started.own.actors]

    async def shutdown(actor: Any) -> None:
        with contextlib.suppress(Exception):  # a RayError: that actor had nothing left
            await actor.shutdown.remote()

    # Side by side: an engine takes seconds to stop its processes.
    await each([functools.partial(shutdown, actor) for actor in actors])
    for actor in actors:
        ray.kill(actor)
    if started.evaluator is not None:
        ray.kill(started.evaluator)
    for group in started.placement_groups:
        remove_placement_group(group)


class RunInterrupted(Exception):
    """A signal ended the run at once (a second one, or one during start-up): no
    checkpoint of the step in progress."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT and SIGTERM during a run: the first asks the orchestrator to stop cleanly
    after the current step (before it exists, during start-up, there is nothing to save:
    the run stops at once); a second one stops the run at once."""

    def __init__(self) -> None:
        self.run: anyio.CancelScope | None = None
        """The scope of the whole run, cancelled to stop at once (set in the event loop)."""
        self.received: list[int] = []
        self.orchestrator: Orchestrator | None = None

    async def watch(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                self.received.append(signum)
                if len(self.received) == 1 and self.orchestrator is not None:
                    self.orchestrator.request_stop(signal.Signals(signum).name)
                elif self.run is not None:
                    self.run.cancel()
                    return


def run_training(config: Config, *, resume: bool = False, verbose: bool = False,
                 rewards: Sequence[Reward] = ()) -> RunSummary:
    """Starts (or joins) Ray, runs the job, and always shuts Ray down if it started it.

    ``rewards``: a script's reward callables, scored besides task.rewards (checked by
    ``async_rl.run.inputs.check_inputs`` before this is called).

    Workers' output goes to RUN_DIR/workers.log, only their warnings and errors to the
    console, unless ``verbose``.

    ``resume``: continue ``run.output_dir`` from its newest good checkpoint (workers start
    from its weights; its unfinished prompts are issued again). Raises
    ``CheckpointError`` when there is none, ``RunInterrupted`` on a second stop signal.
    """
    refused: list[str] = []  # newer checkpoints that did not verify: restore failures

    def warn(line: str) -> None:
        refused.append(line)
        log.warning("%s", line)

    config = config.with_role_paths()  # the reference stays the initial policy on resume
    checkpoint = latest_checkpoint(Path(config.run.output_dir), warn) if resume else None
    workers_config = config
    if checkpoint is not None:
        check_backend(checkpoint.folder, checkpoint.state, config.trainer.backend)
        log.info("resuming %s from %s (version %d)", config.run.output_dir,
                 checkpoint.folder.name, checkpoint.state.version)
        model = msgspec.structs.replace(config.model, path=str(checkpoint.folder / TRAINER))
        workers_config = msgspec.structs.replace(config, model=model)
    # Before Ray: a dataset's rows are read and measured here (a bad one is a ConfigError).
    task = build_task(config)
    workers_task = worker_task(config.task, task, rewards)  # what the workers get of it
    started_ray = not ray.is_initialized()
    if started_ray:
        log_path = os.path.join(config.run.output_dir, WORKERS_LOG)
        console = ray_options(log_path, verbose)
        ray_notices_to_log(log_path, verbose)
        if config.run.ray_address:
            ray.init(address=config.run.ray_address, namespace=NAMESPACE, **console)
        else:
            # "local": a new Ray for this run, never one already running on the machine.
            needed = (config.rollout.num_workers * config.rollout.cpus_per_worker
                      + (config.trainer.num_shards + sum(n for _, n in own_roles(config)))
                      * config.trainer.cpus_per_shard)
            ray.init(address="local", num_cpus=max(config.run.num_cpus, needed),
                     include_dashboard=False, _node_ip_address="127.0.0.1",
                     namespace=NAMESPACE, **console)
    out = RunWriter(config.run.output_dir, config,
                    positions=checkpoint.state.files if checkpoint else None)
    stops = StopSignals()

    async def main() -> RunSummary | None:
        started = StartedWorkers()
        try:
            with anyio.CancelScope() as stops.run:
                async with anyio.create_task_group() as signals:
                    if threading.current_thread() is threading.main_thread():
                        signals.start_soon(stops.watch)  # signals reach the main thread only
                    started = await launch_workers(
                        workers_config, workers_task,
                        version=checkpoint.state.version if checkpoint else 0,
                        resuming=checkpoint is not None)
                    log.info("%s", registry_table(started.identities))
                    out.workers(started.identities)
                    workers = adapt(started, config, adapt_own_roles(started, config))
                    orchestrator = Orchestrator(config, out, task.source, task.eval_prompts,
                                                workers)
                    if checkpoint is not None:
                        orchestrator.restore(checkpoint.state, refused=len(refused))
                    stops.orchestrator = orchestrator
                    summary = await orchestrator.run()
                    signals.cancel_scope.cancel()
                return summary
            return None  # cancelled by a signal
        finally:
            with anyio.CancelScope(shield=True):
                await _shutdown(started)

    try:
        summary = anyio.run(main)
    except BaseExceptionGroup as group:
        # One line for the user, not a tree of task groups.
        failure = first_error(group, (RunFailed, ConfigError, CheckpointError))
        if failure is None:
            raise
        raise failure from None
    finally:
        if started_ray:
            ray.shutdown()
    if summary is None:
        raise RunInterrupted(stops.received[-1])
    return summary
