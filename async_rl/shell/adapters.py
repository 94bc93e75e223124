"""The shell's adapters: Ray actor handles as the orchestrator's protocols.

Owns: one adapter per protocol of ``async_rl.control.protocols`` (``RayRollout``,
``RayTrainer``, ``RayEvaluator``, ``RayWeights``) and the one way every one of them calls
its actor (``_Adapter._call``): with a deadline (``run.call_timeout_s`` unless the call
has its own), Ray's errors turned into the adapter's protocol error, and a missed
deadline into the error the call names (``WaitTimedOut`` by default). Also aligning a
worker's span clock (and a rollout worker's agent sessions') with the driver's. The
reference's and critic's workers of their own have their adapters beside these
(``async_rl.shell.role_adapters``); the started actors become the orchestrator's
``Workers`` in ``async_rl.shell.adapted_workers``. Knows nothing about the run's logic.
"""

from __future__ import annotations

import abc
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import ray

from async_rl.config import Config
from async_rl.control.failures import (
    EvaluationFailed,
    RoleFailed,
    RolloutFailed,
    TrainerFailed,
    WaitTimedOut,
)
from async_rl.control.protocols import (
    CriticClient,
    PolicyWeights,
    PublishedWeights,
    RoleOutput,
)
from buffers.common.concurrent_calls import each
from buffers.common.partials import PartialGroup
from buffers.common.records import Group, Prompt
from buffers.common.reports import BroadcastTiming, CriticStepResult, EvalResult, UsageReading
from buffers.common.train_records import ShardBatch, ShardStepResult
from workers.common.errors import RolloutWorkerError, first_line
from workers.common.spans import SessionSpan, Span
from workers.trainer.checkpoint_folder import WAIT_GROUP
from workers.weights.broadcast import Published, WeightBroadcast

OnTimeout = Callable[[str], Exception]
"""What a missed deadline raises, given "after N s (key)"."""


def _out_of_memory(err: BaseException) -> bool:
    """Ray's memory monitor killed the worker, or the call itself ran out of memory."""
    cause = getattr(err, "cause", None)
    return (isinstance(err, ray.exceptions.OutOfMemoryError)
            or isinstance(cause, MemoryError)
            or type(cause).__name__ == "OutOfMemoryError"  # torch's, CPU or CUDA
            or "out of memory" in str(err).lower())


def _reason(err: ray.exceptions.RayError) -> str:
    """The error's type, and its cause's type and first line when the actor raised."""
    cause = getattr(err, "cause", None)
    if cause is None:
        return type(err).__name__
    return first_line(cause)


class _Adapter(abc.ABC):
    """An actor handle and the one way to call it; subclasses say what Ray's errors
    mean for their protocol (``_failed``)."""

    def __init__(self, name: str, handle: Any, config: Config) -> None:
        self._name, self.handle, self.config = name, handle, config

    @property
    def name(self) -> str:
        return self._name

    @abc.abstractmethod
    def _failed(self, err: ray.exceptions.RayError, what: str) -> Exception:
        """The protocol's error for ``err``, raised by the call to ``what``."""

    async def _call(self, method: str, *args: Any, concurrency_group: str | None = None,
                    **wait: Any) -> Any:
        """``handle.method.remote(*args)``, in the actor's ``concurrency_group`` if
        given, waited for as ``_result`` says (``wait``: its keywords)."""
        call = getattr(self.handle, method)
        if concurrency_group is not None:
            call = call.options(concurrency_group=concurrency_group)
        return await self._result(call.remote(*args), method, **wait)

    async def _result(self, pending: Any, method: str, *, seconds: float | None = None,
                      key: str = "run.call_timeout_s", what: str = "",
                      on_timeout: OnTimeout | None = None) -> Any:
        """The result of a call to ``method`` already made (``pending``: its reference)
        within ``seconds`` (default run.call_timeout_s, named by ``key``). Ray's errors
        raise ``_failed(err, what)`` (``what`` defaults to the method); a missed
        deadline raises ``on_timeout`` of the wait, or ``WaitTimedOut`` naming the call."""
        seconds = self.config.run.call_timeout_s if seconds is None else seconds
        try:
            with anyio.move_on_after(seconds):
                return await pending
        except ray.exceptions.RayError as err:
            raise self._failed(err, what or method) from err
        if on_timeout is None:
            raise WaitTimedOut(f"{self._name}.{method}", seconds, key)
        raise on_timeout(f"after {seconds:g} s ({key})")


class WorkerAdapter(_Adapter):
    """What every worker adapter reports: OS usage and clock-aligned spans."""

    async def usage(self) -> UsageReading:
        reading: UsageReading = await self._call("usage")
        return reading

    async def _offset(self) -> float:
        """The worker's clock minus this process's (workers may sit on other nodes), at
        the midpoint of a call that reads it."""
        sent = time.time()
        remote_now: float = await self._call("clock")
        return remote_now - (sent + time.time()) / 2

    async def spans(self) -> list[Span]:
        """The worker's spans shifted onto this process's clock."""
        offset = await self._offset()
        spans: list[Span] = await self._call("drain_spans")
        return [msgspec.structs.replace(s, start=s.start - offset, end=s.end - offset)
                for s in spans]


class RayRollout(WorkerAdapter):
    """A ``RolloutClient`` over a ``workers.actors.RolloutActor`` handle."""

    leaving = ""
    """Why the engine is being stopped ("": it is not): its calls fail with that reason."""
    pid = 0
    """Its process, once ``restart_rollout`` started it (0: not known here)."""

    def _failed(self, err: ray.exceptions.RayError, what: str) -> Exception:
        # Dead (the actor is gone) or broken (it refuses work after a failed weight
        # load): either way it gets no more prompts. Anything else fails this call.
        if self.leaving:
            return RolloutFailed(self.leaving, worker_gone=True)
        broken = isinstance(getattr(err, "cause", None), RolloutWorkerError)
        gone = broken or isinstance(err, ray.exceptions.RayActorError)
        return RolloutFailed(type(err).__name__, worker_gone=gone,
                             out_of_memory=_out_of_memory(err))

    @staticmethod
    def _stuck(method: str) -> OnTimeout:
        # A stuck engine: it is replaced like a dead one.
        return lambda waited: RolloutFailed(f"no answer to {method} {waited}",
                                            worker_gone=True, timed_out=True)

    async def generate(self, prompt: Prompt) -> Group | PartialGroup:
        group: Group | PartialGroup = await self._call(
            "generate_group_ref", prompt, seconds=self.config.rollout.generate_timeout_s,
            key="rollout.generate_timeout_s", on_timeout=self._stuck("generate_group_ref"))
        return group

    async def continue_group(self, partial: PartialGroup) -> Group | PartialGroup:
        group: Group | PartialGroup = await self._call(
            "continue_group_ref", partial, seconds=self.config.rollout.generate_timeout_s,
            key="rollout.generate_timeout_s", on_timeout=self._stuck("continue_group_ref"))
        return group

    async def hand_back(self) -> int:
        groups: int = await self._call("hand_back")
        return groups

    async def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        result: EvalResult = await self._call("evaluate", list(prompts),
                                              on_timeout=self._stuck("evaluate"))
        return result

    async def version(self) -> int:
        version: int = await self._call("version")
        return version

    async def sessions(self) -> list[SessionSpan]:
        """The agent sessions the worker kept, shifted onto this process's clock."""
        offset = await self._offset()
        sessions: list[SessionSpan] = await self._call("drain_sessions")
        return [s.shifted(-offset) for s in sessions]

    async def start(self) -> int:
        """Starts a replacement's engine (``restart_rollout``), within
        run.call_timeout_s: one that does not is stuck, like a worker that stops
        answering (``RolloutFailed``). Its process id."""
        pid: int = await self._call("start", on_timeout=self._stuck("start"))
        return pid


class RayTrainer(WorkerAdapter):
    """A ``TrainerClient`` over a ``workers.actors.TrainerActor`` handle."""

    def __init__(self, rank: int, handle: Any, config: Config) -> None:
        super().__init__(f"trainer-{rank}", handle, config)
        self.rank = rank
        self.peers: list[RayTrainer] = []
        """The shards that take part in each of this one's calls that read the whole
        policy or write a checkpoint (trainer.backend = "fsdp2", shard 0's client: the
        others hold the rest of the state); empty with ddp, whose shards are replicas."""
        self.critics: Sequence[CriticClient] = ()
        """The critic's workers of their own (critic.placement = "own"): a checkpoint
        this shard writes holds their state too (they are replicas: the first live one
        writes it)."""

    async def _everywhere(self, method: str, *args: Any, **options: Any) -> Any:
        """``method`` on this shard and its peers at once; this shard's answer."""
        results = await each([functools.partial(shard._call, method, *args, **options)
                               for shard in (self, *self.peers)])
        return results[0]

    def _failed(self, err: ray.exceptions.RayError, what: str) -> Exception:
        return TrainerFailed(self.rank, f"{what}: {_reason(err)}",
                             dead=isinstance(err, ray.exceptions.RayActorError),
                             out_of_memory=_out_of_memory(err))

    async def train(self, batch: ShardBatch) -> ShardStepResult:
        # Stuck (in a collective whose peer died, say): it cannot save either.
        def stuck(waited: str) -> Exception:
            return TrainerFailed(self.rank, f"no answer to step {batch.step} {waited}",
                                 dead=True, timed_out=True)

        result: ShardStepResult = await self._call(
            "train_step_by_ref", batch, seconds=self.config.trainer.step_timeout_s,
            key="trainer.step_timeout_s", what=f"step {batch.step}", on_timeout=stuck)
        return result

    async def mean_cores(self) -> float:
        cores: float = await self._call("mean_cores")
        return cores

    async def connect_rollout(self, rank: int, handle: Any) -> None:
        """Makes rollout worker ``rank`` (the actor ``handle``, a replacement) a member
        of this shard's weight group. Queued behind a step in progress, so within
        trainer.step_timeout_s."""
        await self._call("connect_rollout", rank, handle,
                         seconds=self.config.trainer.step_timeout_s,
                         key="trainer.step_timeout_s", what=f"connect_rollout of rollout-{rank}")

    # ---- the PPO dataflow's stages (a RoleStagesClient: the same actor) ----------------

    async def _stage(self, method: str, step: int, *args: Any) -> Any:
        def stuck(waited: str) -> Exception:
            return TrainerFailed(self.rank, f"no answer to {method} of step {step} {waited}",
                                 dead=True, timed_out=True)

        return await self._call(method, *args, seconds=self.config.trainer.step_timeout_s,
                                key="trainer.step_timeout_s", what=f"{method} of step {step}",
                                on_timeout=stuck)

    async def prepare_step(self, batch: ShardBatch) -> bool:
        lost: bool = await self._stage("prepare_step_by_ref", batch.step, batch)
        return lost

    async def reference_logprobs(self, step: int) -> None:
        await self._stage("reference_logprobs", step, step)

    async def critic_values(self, step: int) -> None:
        await self._stage("critic_values", step, step)

    async def advantages(self, step: int) -> None:
        await self._stage("advantages", step, step)

    async def critic_update(self, step: int) -> CriticStepResult:
        result: CriticStepResult = await self._stage("critic_update", step, step)
        return result

    async def take_reference(self, step: int, logprobs: RoleOutput) -> None:
        assert isinstance(logprobs, RayRoleOutput)
        # A reference as an argument: Ray hands the shard the tensors themselves.
        await self._stage("take_reference", step, step, logprobs.ref)

    async def take_advantages(self, step: int, advantages: RoleOutput) -> None:
        assert isinstance(advantages, RayRoleOutput)
        await self._stage("take_advantages", step, step, advantages.ref)

    async def step_lost(self, step: int) -> None:
        await self._stage("step_lost", step, step)

    async def policy_logprobs(self, step: int) -> RoleOutput:
        ref = await self._stage("policy_logprobs_ref", step, step)
        return RayRoleOutput(ref)

    async def policy_weights(self, version: int) -> RayPolicyWeights:
        # Not awaited: submitted before the next step's call, the copy runs in order with
        # training calls, and the evaluator fetches it from the object store itself.
        # Peers join the gather (their answers are empty).
        for peer in self.peers:
            peer.handle.policy_state.remote()
        return RayPolicyWeights(version=version, state=self.handle.policy_state.remote())

    async def save(self, out_dir: str) -> None:
        await self._everywhere("save", out_dir)

    async def save_policy(self, out_dir: str) -> None:
        await self._everywhere("save_policy", out_dir)

    async def save_checkpoint(self, out_dir: str) -> None:
        await self._everywhere("save_checkpoint", out_dir)
        for index, critic in enumerate(self.critics):
            try:
                await critic.save_checkpoint(out_dir)
                break
            except RoleFailed:
                if index == len(self.critics) - 1:
                    raise  # the critic's state died with its last worker

    async def checkpoint_written(self) -> None:
        # Beside training calls; a write takes about as long as a step may.
        await self._everywhere("checkpoint_written", seconds=self.config.trainer.step_timeout_s,
                               key="trainer.step_timeout_s", concurrency_group=WAIT_GROUP)


@dataclass(frozen=True)
class RayRoleOutput:
    """A ``RoleOutput``: a reference to one shard's share, in its role worker's store."""

    ref: ray.ObjectRef[Any]


@dataclass(frozen=True)
class RayPolicyWeights:
    """A ``PolicyWeights``: a reference to trainer shard 0's copy of one version."""

    version: int
    state: ray.ObjectRef[Any]


class RayEvaluator(_Adapter):
    """An ``Evaluator`` over a ``workers.eval.evaluator.IdleCpuEvaluator`` actor."""

    def _failed(self, err: ray.exceptions.RayError, what: str) -> Exception:
        return EvaluationFailed(first_line(err))

    async def evaluate(self, prompts: Sequence[Prompt], weights: PolicyWeights) -> EvalResult:
        assert isinstance(weights, RayPolicyWeights)
        # A reference as an argument: Ray hands the actor the weights themselves.
        result: EvalResult = await self._call(
            "evaluate", list(prompts), weights.state, weights.version,
            on_timeout=lambda waited: EvaluationFailed(f"no answer {waited}"))
        return result


class RayWeights:
    """A ``WeightPath`` over ``workers.weights.broadcast.WeightBroadcast``: trainer shard 0
    sends to each rollout worker it was connected to, by rank."""

    def __init__(self, broadcast: WeightBroadcast) -> None:
        self._broadcast = broadcast

    async def publish(self, version: int) -> Published:
        return await self._broadcast.publish(version)

    async def deliver(self, published: PublishedWeights, ranks: Sequence[int]
                      ) -> tuple[list[BroadcastTiming], list[int]]:
        assert isinstance(published, Published)
        return await self._broadcast.deliver(published, ranks)
