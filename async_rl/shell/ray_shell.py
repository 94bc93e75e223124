"""The Ray shell: starts Ray and the workers, adapts actor handles to the protocols, runs.

Owns: everything Ray in the control plane — ``ray.init`` (or joining a cluster), creating
the actors (through ``async_rl.shell.launch``), one small adapter per protocol of
``async_rl.control.protocols`` that turns ``handle.method.remote(...)`` into awaitable calls and
Ray's errors into the protocols' errors, aligning worker span clocks with the driver's,
and shutting everything down. The run's logic is ``async_rl.control.orchestrator``'s; nothing
here decides anything about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import ray
from ray.util.placement_group import remove_placement_group

from async_rl.config import Config
from async_rl.control.checkpoint import TRAINER, CheckpointError, latest_checkpoint
from async_rl.control.orchestrator import Orchestrator
from async_rl.control.protocols import (
    EvaluationFailed,
    PolicyWeights,
    PublishedWeights,
    RolloutFailed,
    RunFailed,
    TrainerFailed,
    WaitTimedOut,
    Workers,
    first_error,
)
from async_rl.run.run_dir import WORKERS_LOG, RunWriter
from async_rl.run.summary import RunSummary
from async_rl.shell.launch import StartedWorkers, build_task, launch_workers, restart_rollout
from async_rl.shell.worker_logs import ray_options
from buffers.config import ConfigError
from buffers.records import (
    BroadcastTiming,
    EvalResult,
    Group,
    Prompt,
    ShardBatch,
    ShardStepResult,
    UsageReading,
)
from workers.errors import RolloutWorkerError
from workers.placement import registry_table
from workers.spans import Span
from workers.weights.broadcast import Published, WeightBroadcast

NAMESPACE = "async-rl"
"""Ray namespace of a run's named actors ("rollout-0", "trainer-1", ...)."""


def _out_of_memory(err: BaseException) -> bool:
    """Ray's memory monitor killed the worker, or the call itself ran out of memory."""
    cause = getattr(err, "cause", None)
    return (isinstance(err, ray.exceptions.OutOfMemoryError)
            or isinstance(cause, MemoryError)
            or type(cause).__name__ == "OutOfMemoryError"  # torch's, CPU or CUDA
            or "out of memory" in str(err).lower())


class _Actor:
    """What every worker adapter shares: its name, OS usage and clock-aligned spans, and
    a deadline on every call (``run.call_timeout_s`` unless the call has its own)."""

    def __init__(self, name: str, handle: Any, config: Config) -> None:
        self._name, self.handle, self.config = name, handle, config

    @property
    def name(self) -> str:
        return self._name

    async def _answer(self, method: str, *args: Any) -> Any:
        """``handle.method.remote(*args)``, or ``WaitTimedOut`` past run.call_timeout_s."""
        seconds = self.config.run.call_timeout_s
        with anyio.move_on_after(seconds):
            return await getattr(self.handle, method).remote(*args)
        raise WaitTimedOut(f"{self._name}.{method}", seconds, "run.call_timeout_s")

    async def usage(self) -> UsageReading:
        reading: UsageReading = await self._answer("usage")
        return reading

    async def spans(self) -> list[Span]:
        """The worker's spans shifted onto this process's clock (workers may sit on other
        nodes): the offset is the remote clock minus ours at the call's midpoint."""
        sent = time.time()
        remote_now: float = await self._answer("clock")
        offset = remote_now - (sent + time.time()) / 2
        spans: list[Span] = await self._answer("drain_spans")
        return [msgspec.structs.replace(s, start=s.start - offset, end=s.end - offset)
                for s in spans]


class RayRollout(_Actor):
    """A ``RolloutClient`` over a ``workers.actors.RolloutActor`` handle."""

    async def generate(self, prompt: Prompt) -> Group:
        group: Group = await self._call(self.config.rollout.generate_timeout_s,
                                        "rollout.generate_timeout_s",
                                        "generate_group_ref", prompt)
        return group

    async def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        result: EvalResult = await self._call(self.config.run.call_timeout_s,
                                              "run.call_timeout_s", "evaluate", list(prompts))
        return result

    async def version(self) -> int:
        version: int = await self._answer("version")
        return version

    async def _call(self, seconds: float, key: str, method: str, *args: Any) -> Any:
        try:
            with anyio.move_on_after(seconds):
                return await getattr(self.handle, method).remote(*args)
        except ray.exceptions.RayError as err:
            # Dead (the actor is gone) or broken (it refuses work after a failed weight
            # load): either way it gets no more prompts. Anything else fails this call.
            broken = isinstance(getattr(err, "cause", None), RolloutWorkerError)
            gone = broken or isinstance(err, ray.exceptions.RayActorError)
            raise RolloutFailed(type(err).__name__, worker_gone=gone,
                                out_of_memory=_out_of_memory(err)) from err
        # A stuck engine: it is replaced like a dead one.
        raise RolloutFailed(f"no answer to {method} after {seconds:g} s ({key})",
                            worker_gone=True, timed_out=True)


class RayTrainer(_Actor):
    """A ``TrainerClient`` over a ``workers.actors.TrainerActor`` handle."""

    def __init__(self, rank: int, handle: Any, config: Config) -> None:
        super().__init__(f"trainer-{rank}", handle, config)
        self.rank = rank

    async def train(self, batch: ShardBatch) -> ShardStepResult:
        seconds = self.config.trainer.step_timeout_s
        try:
            with anyio.move_on_after(seconds):
                result: ShardStepResult = await self.handle.train_step_by_ref.remote(batch)
                return result
        except ray.exceptions.RayError as err:
            cause = getattr(err, "cause", None)
            reason = type(err).__name__ if cause is None else f"{type(cause).__name__}: {cause}"
            raise TrainerFailed(self.rank, f"step {batch.step}: {reason.splitlines()[0]}",
                                dead=isinstance(err, ray.exceptions.RayActorError),
                                out_of_memory=_out_of_memory(err)) from err
        # Stuck (in a collective whose peer died, say): it cannot save either.
        raise TrainerFailed(self.rank, f"no answer to step {batch.step} after {seconds:g} s "
                            "(trainer.step_timeout_s)", dead=True, timed_out=True)

    async def mean_cores(self) -> float:
        cores: float = await self._answer("mean_cores")
        return cores

    async def policy_weights(self, version: int) -> RayPolicyWeights:
        # Not awaited: submitted before the next step's call, the copy runs in order with
        # training calls, and the evaluator fetches it from the object store itself.
        return RayPolicyWeights(version=version, state=self.handle.policy_state.remote())

    async def save(self, out_dir: str) -> None:
        await self._answer("save", out_dir)

    async def save_policy(self, out_dir: str) -> None:
        await self._answer("save_policy", out_dir)

    async def save_checkpoint(self, out_dir: str) -> None:
        await self._answer("save_checkpoint", out_dir)


@dataclass(frozen=True)
class RayPolicyWeights:
    """A ``PolicyWeights``: a reference to trainer shard 0's copy of one version."""

    version: int
    state: ray.ObjectRef[Any]


class RayEvaluator:
    """An ``Evaluator`` over a ``workers.eval.evaluator.IdleCpuEvaluator`` actor."""

    def __init__(self, handle: Any, config: Config) -> None:
        self.handle, self.config = handle, config

    async def evaluate(self, prompts: Sequence[Prompt], weights: PolicyWeights) -> EvalResult:
        assert isinstance(weights, RayPolicyWeights)
        seconds = self.config.run.call_timeout_s
        try:
            with anyio.move_on_after(seconds):
                # A reference as an argument: Ray hands the actor the weights themselves.
                result: EvalResult = await self.handle.evaluate.remote(
                    list(prompts), weights.state, weights.version)
                return result
        except ray.exceptions.RayError as err:
            raise EvaluationFailed(f"{type(err).__name__}: {str(err).splitlines()[0]}") from err
        raise EvaluationFailed(f"no answer after {seconds:g} s (run.call_timeout_s)")


class RayWeights:
    """A ``WeightPath`` over ``workers.weights.broadcast.WeightBroadcast`` and the rollout
    handles."""

    def __init__(self, source_shard: Any, rollout: dict[int, Any]) -> None:
        self._rollout = rollout
        self._broadcast = WeightBroadcast(source_shard, dict(rollout))

    async def publish(self, version: int) -> Published:
        return await self._broadcast.publish(version)

    async def deliver(self, published: PublishedWeights, ranks: Sequence[int]
                      ) -> tuple[list[BroadcastTiming], list[int]]:
        assert isinstance(published, Published)
        self._broadcast.rollout_workers = {r: self._rollout[r] for r in ranks}
        return await self._broadcast.deliver(published)


def adapt(started: StartedWorkers, config: Config) -> Workers:
    """The started actors as the orchestrator's protocols."""
    weights = RayWeights(started.trainers[0], started.rollout)

    async def restart(rank: int, model_dir: str, version: int) -> RayRollout:
        model = msgspec.structs.replace(config.model, path=model_dir)
        # Also updates started.rollout, the map later deliveries read.
        handle = await restart_rollout(started, rank, model, version)
        return RayRollout(f"rollout-{rank}", handle, config)

    return Workers(
        rollout={rank: RayRollout(f"rollout-{rank}", handle, config)
                 for rank, handle in started.rollout.items()},
        trainers=[RayTrainer(rank, handle, config)
                  for rank, handle in enumerate(started.trainers)],
        weights=weights,
        evaluator=(RayEvaluator(started.evaluator, config)
                   if started.evaluator is not None else None),
        restart_rollout=restart,
    )


async def _shutdown(started: StartedWorkers) -> None:
    """Stops the engines and process groups, then the actors and their placement groups:
    on a cluster the shell joined, nothing of the run is left behind."""
    for actor in [*started.rollout.values(), *started.trainers]:
        with contextlib.suppress(ray.exceptions.RayError):
            await actor.shutdown.remote()
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


def _start_ray(config: Config, verbose: bool) -> None:
    needed = (config.rollout.num_workers * config.rollout.cpus_per_worker
              + config.trainer.num_shards * config.trainer.cpus_per_shard)
    console = ray_options(os.path.join(config.run.output_dir, WORKERS_LOG), verbose)
    if config.run.ray_address:
        ray.init(address=config.run.ray_address, namespace=NAMESPACE, **console)
    else:
        # "local": a new Ray for this run, never one already running on the machine.
        ray.init(address="local", num_cpus=max(config.run.num_cpus, needed),
                 include_dashboard=False, _node_ip_address="127.0.0.1", namespace=NAMESPACE,
                 **console)


def run_training(config: Config, *, resume: bool = False, verbose: bool = False
                 ) -> RunSummary:
    """Starts (or joins) Ray, runs the job, and always shuts Ray down if it started it.

    Workers' output goes to RUN_DIR/workers.log, only their warnings and errors to the
    console, unless ``verbose``.

    ``resume``: continue ``run.output_dir`` from its newest good checkpoint (workers start
    from its weights; its unfinished prompts are issued again). Raises
    ``CheckpointError`` when there is none, ``RunInterrupted`` on a second stop signal.
    """
    refused: list[str] = []  # newer checkpoints that did not verify: restore failures

    def warn(line: str) -> None:
        refused.append(line)
        print(line)

    checkpoint = latest_checkpoint(Path(config.run.output_dir), warn) if resume else None
    workers_config = config
    if checkpoint is not None:
        print(f"resuming {config.run.output_dir} from {checkpoint[0].name} "
              f"(version {checkpoint[1].version})")
        model = msgspec.structs.replace(config.model, path=str(checkpoint[0] / TRAINER))
        workers_config = msgspec.structs.replace(config, model=model)
    started_ray = not ray.is_initialized()
    if started_ray:
        _start_ray(config, verbose)
    out = RunWriter(config.run.output_dir, config,
                    positions=checkpoint[1].files if checkpoint else None)
    source, reward_fn, eval_prompts = build_task(config)
    stops = StopSignals()

    async def main() -> RunSummary | None:
        started = StartedWorkers()
        try:
            with anyio.CancelScope() as stops.run:
                async with anyio.create_task_group() as signals:
                    if threading.current_thread() is threading.main_thread():
                        signals.start_soon(stops.watch)  # signals reach the main thread only
                    started = await launch_workers(
                        workers_config, reward_fn,
                        version=checkpoint[1].version if checkpoint else 0)
                    print(registry_table(started.identities))
                    out.workers(started.identities)
                    orchestrator = Orchestrator(config, out, source, eval_prompts,
                                                adapt(started, config))
                    if checkpoint is not None:
                        await asyncio.gather(*(t.load_training_state.remote(
                            workers_config.model.path) for t in started.trainers))
                        orchestrator.restore(checkpoint[1], refused=len(refused))
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
