"""The Ray shell: starts Ray and the workers, adapts actor handles to the protocols, runs.

Owns: ``run_training`` as named steps: the job (the run's roster, ``async_rl.roster``,
starting from a checkpoint when resuming; its task), ``ray.init`` with the roster's CPUs
(or joining a cluster), creating the actors (through ``async_rl.shell.launch``), the
registry printout, and handing them to the orchestrator as its protocols
(``async_rl.shell.adapters``; with ``[autopilot]``'s engine count, the engines it adds:
``async_rl.shell.lending``), resuming from a checkpoint, stop signals, and shutting
everything down. The run's logic is ``async_rl.control.orchestrator``'s; nothing
here decides anything about it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import psutil
import ray
from ray._private import worker as ray_worker
from ray.util.placement_group import remove_placement_group

from async_rl.config import Config
from async_rl.control.autopilot import ENGINES
from async_rl.control.checkpoint_files import (
    TRAINER,
    CheckpointError,
    RunState,
    check_backend,
    latest_checkpoint,
)
from async_rl.control.failures import RunFailed, first_error
from async_rl.control.orchestrator import Orchestrator
from async_rl.roster import Roster, Start, registry_table, resumed_engines, roster
from async_rl.run.run_dir import WORKERS_LOG, RunWriter
from async_rl.run.summary import RunSummary
from async_rl.shell.adapted_workers import adapt
from async_rl.shell.adapters import RayTrainer
from async_rl.shell.launch import StartedWorkers, launch_workers
from async_rl.shell.lending import RayLending
from async_rl.shell.role_adapters import adapt_own_roles
from async_rl.shell.worker_logs import ray_notices_to_log, ray_options
from async_rl.tasks.table import Task, build_task, worker_task
from buffers.common.concurrent_calls import each
from buffers.common.config import ConfigError
from workers.rewards.callables import Reward
from workers.rollout.task import WorkerTask

log = logging.getLogger(__name__)

NAMESPACE = "async-rl"
"""Ray namespace of a run's named actors ("rollout-0", "trainer-1", ...)."""

LOCAL_RAY_SYSTEM = {"prestart_worker_first_driver": False}
"""Ray settings of a run's own local Ray. Ray starts one idle worker per CPU for the
first driver; a run's actors never take them (Ray starts a worker of their own for each
actor, and kills the idle ones later), so each local start spent about 1 CPU-second on
processes nothing used (docs/benchmarks.md, "Demo and test timings")."""


async def _shutdown(started: StartedWorkers) -> None:
    """Stops the engines and process groups, then the actors and their placement groups:
    on a cluster the shell joined, nothing of the run is left behind."""
    actors = started.actors

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
    """SIGINT, SIGTERM and run.stop_signal during a run: the first asks the orchestrator
    to stop cleanly after the current step (before it exists, during start-up, there is
    nothing to save: the run stops at once); a second one stops the run at once."""

    def __init__(self, stop_signal: str = "") -> None:
        self.run: anyio.CancelScope | None = None
        """The scope of the whole run, cancelled to stop at once (set in the event loop)."""
        self.received: list[int] = []
        self.orchestrator: Orchestrator | None = None
        self.signals = (signal.SIGINT, signal.SIGTERM,
                        *([signal.Signals[stop_signal]] if stop_signal else []))

    async def watch(self) -> None:
        with anyio.open_signal_receiver(*self.signals) as signals:
            async for signum in signals:
                self.received.append(signum)
                if len(self.received) == 1 and self.orchestrator is not None:
                    self.orchestrator.request_stop(signal.Signals(signum).name)
                elif self.run is not None:
                    self.run.cancel()
                    return


@dataclass(frozen=True)
class Job:
    """What a run is given before Ray starts: its config and roster, its task, what the
    workers get of it, and (resuming) the checkpoint's orchestrator state."""

    config: Config
    plan: Roster
    task: Task
    workers_task: WorkerTask
    state: RunState | None = None
    refused: int = 0
    """Newer checkpoints that did not verify (counted as restore failures)."""


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
    job = resumed_job(config, rewards) if resume else new_job(config, rewards)
    started_ray = start_ray(config, job.plan, verbose)
    out = RunWriter(config.run.output_dir, config,
                    positions=job.state.files if job.state is not None else None)
    stops = StopSignals(config.run.stop_signal)
    try:
        summary = anyio.run(serve, job, out, stops)
    except BaseExceptionGroup as group:
        # One line for the user, not a tree of task groups.
        failure = first_error(group, (RunFailed, ConfigError, CheckpointError))
        if failure is None:
            raise
        raise failure from None
    finally:
        if started_ray:
            shutdown_local_ray()
    if summary is None:
        raise RunInterrupted(stops.received[-1])
    return summary


def new_job(config: Config, rewards: Sequence[Reward], start: Start | None = None,
            state: RunState | None = None, refused: int = 0) -> Job:
    """The job of ``config`` with its workers starting from ``start`` (None: a new run;
    resumed, with the engines ``[autopilot]`` had when ``state`` was saved: within the
    config's bounds, ``resumed_engines``). Before Ray: a dataset's rows are read and
    measured here (a bad one is a ConfigError)."""
    task = build_task(config)
    engines = 0
    if state is not None and state.autopilot is not None:
        engines, clamped = resumed_engines(config, state.autopilot.values.get(ENGINES, 0))
        if clamped:
            log.warning("%s", clamped)
    return Job(config=config, plan=roster(config, start, engines=engines), task=task,
               workers_task=worker_task(config.task, task, rewards,
                                         model_name=config.model.path), state=state,
               refused=refused)


def resumed_job(config: Config, rewards: Sequence[Reward]) -> Job:
    """The job that continues ``run.output_dir`` from its newest good checkpoint: the
    policy's weights and version are the checkpoint's (``async_rl.roster.Start``)."""
    refused: list[str] = []  # newer checkpoints that did not verify: restore failures

    def warn(line: str) -> None:
        refused.append(line)
        log.warning("%s", line)

    checkpoint = latest_checkpoint(Path(config.run.output_dir), warn)
    check_backend(checkpoint.folder, checkpoint.state, config.trainer.backend)
    log.info("resuming %s from %s (version %d)", config.run.output_dir,
             checkpoint.folder.name, checkpoint.state.version)
    start = Start(policy_path=str(checkpoint.folder / TRAINER),
                  version=checkpoint.state.version)
    return new_job(config, rewards, start, checkpoint.state, len(refused))


def start_ray(config: Config, plan: Roster, verbose: bool) -> bool:
    """Joins run.ray_address, or starts a local Ray with the CPUs the roster's workers
    ask for (run.num_cpus when more); False when Ray runs already (the caller's)."""
    if ray.is_initialized():
        return False
    log_path = os.path.join(config.run.output_dir, WORKERS_LOG)
    console = ray_options(log_path, verbose)
    ray_notices_to_log(log_path, verbose)
    if config.run.ray_address:
        ray.init(address=config.run.ray_address, namespace=NAMESPACE, **console)
    else:
        # "local": a new Ray for this run, never one already running on the machine.
        with sigterm_blocked():
            ray.init(address="local", num_cpus=max(config.run.num_cpus, plan.cpus),
                     include_dashboard=False, _node_ip_address="127.0.0.1",
                     namespace=NAMESPACE, _system_config=LOCAL_RAY_SYSTEM, **console)
    return True


@contextlib.contextmanager
def sigterm_blocked() -> Iterator[None]:
    """SIGTERM blocked in this thread while it starts Ray's processes: they (Ray's control
    store, its raylet, and through it every worker and engine process) inherit the mask
    across fork and exec, so a scheduler's SIGTERM to every process of the job stays
    pending in them while the driver stops the run cleanly. A handler they install does
    not unblock it; ``shutdown_local_ray`` ends them with SIGKILL.
    A SIGTERM to the driver meanwhile is delivered when the block ends."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def shutdown_local_ray() -> None:
    """Shuts down the Ray this run started (``sigterm_blocked``: its processes keep SIGTERM
    pending). The driver disconnects as in ``ray.shutdown``; Ray's processes then get
    SIGKILL at once (a SIGTERM, ``ray.shutdown``'s first try, would leave each pending
    for a second's wait), and so does every process below them still alive (a worker,
    an engine or a log forwarder): nothing of the run is left behind."""
    node = getattr(ray_worker, "_global_node", None)
    processes = [info.process.pid for infos in node.all_processes.values()
                 for info in infos] if node is not None else []
    tree = _with_descendants(processes)
    ray_worker._global_node = None  # so ray.shutdown only disconnects
    try:
        ray.shutdown()
    finally:
        if node is not None:
            if node.is_head():
                node.destroy_external_storage()
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        for process in tree:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(tree, timeout=10)


def _with_descendants(pids: Sequence[int]) -> list[psutil.Process]:
    processes: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            processes += [process, *process.children(recursive=True)]
    return processes


async def serve(job: Job, out: RunWriter, stops: StopSignals) -> RunSummary | None:
    """Launches the workers and runs the orchestrator over them, watching for stop
    signals; always shuts the workers down. None: a signal stopped the run at once."""
    started = StartedWorkers()
    try:
        with anyio.CancelScope() as stops.run:
            async with anyio.create_task_group() as signals:
                if threading.current_thread() is threading.main_thread():
                    signals.start_soon(stops.watch)  # signals reach the main thread only
                await launch_workers(job.config, job.plan, job.workers_task, started)
                summary = await orchestrate(job, started, out, stops)
                signals.cancel_scope.cancel()
            return summary
        return None  # cancelled by a signal
    finally:
        with anyio.CancelScope(shield=True):
            await _shutdown(started)


async def orchestrate(job: Job, started: StartedWorkers, out: RunWriter,
                      stops: StopSignals) -> RunSummary:
    """Says where the workers run, then runs the orchestrator over them (restored from
    the checkpoint's state when resuming)."""
    log.info("%s", registry_table(started.identities))
    out.workers(started.identities)
    config = job.config
    workers = adapt(started, config, adapt_own_roles(started, config))
    lending = None
    if job.plan.lendable:  # [autopilot]'s engine count: engines join and leave
        assert isinstance(workers.trainers[0], RayTrainer)
        lending = RayLending(config, started, workers.trainers[0], registry=out.workers)
        resumed = {entry.rank for entry in job.plan.started[len(job.plan.entries):]}
        workers = dataclasses.replace(workers, lending=lending, rollout={
            rank: lending.adopt(rank, worker) if rank in resumed else worker
            for rank, worker in workers.rollout.items()})
    orchestrator = Orchestrator(config, out, job.task.source, job.task.eval_prompts, workers)
    if lending is not None:
        lending.attach(orchestrator.policy.written_for, orchestrator.policy.current)
    if job.state is not None:
        orchestrator.restore(job.state, refused=job.refused)
    stops.orchestrator = orchestrator
    return await orchestrator.run()
