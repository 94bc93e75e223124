"""What the orchestrator may ask of its workers: the protocols, and the errors they raise.

Owns: the orchestrator's whole view of the compute plane — a rollout worker
(``RolloutClient``), a trainer shard (``TrainerClient``), the weight path
(``WeightPath``), the evaluator beside them (``Evaluator``), what every worker reports
for the idle accounting (``ObservedWorker``), the PPO dataflow's stages on the trainer shards
(``RoleStagesClient``), the bundle the shell hands over
(``Workers``) and the failures: a worker's (``RolloutFailed``, ``EvaluationFailed``)
and the run's (``RunFailed``). Knows nothing about Ray: ``async_rl.shell.ray_shell`` adapts
actor handles to these protocols, and the unit tests pass in-process fakes, so the
orchestrator's loops run the same against both.

Data moves by reference: a ``Group`` a rollout worker returns carries no tokens, only a
reference (``Group.tokens``) that the trainer shards resolve themselves.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from buffers.records import Group, Prompt, ShardBatch, ShardStepResult
from buffers.reports import BroadcastTiming, CriticStepResult, EvalResult, UsageReading
from workers.spans import Span

E = TypeVar("E", bound=Exception)


class RolloutFailed(Exception):
    """A rollout call did not produce its result.

    ``worker_gone``: the worker is dead or broken (a failed weight load, say) and must
    get no more work; otherwise only this call failed.
    """

    def __init__(self, reason: str, *, worker_gone: bool, out_of_memory: bool = False,
                 timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.worker_gone = worker_gone
        self.out_of_memory = out_of_memory
        self.timed_out = timed_out


class ObservedWorker(Protocol):
    """What every worker reports for the idle accounting and the CPU-time cross-check."""

    @property
    def name(self) -> str:
        """e.g. "rollout-0", "trainer-1": the worker's track in spans and usage."""
        ...

    async def usage(self) -> UsageReading:
        """Cumulative OS counters of the worker's process tree."""
        ...

    async def spans(self) -> list[Span]:
        """Closed spans since the last call, on the orchestrator's clock."""
        ...


class RolloutClient(ObservedWorker, Protocol):
    """A rollout engine: generates scored groups, evaluates, runs one policy version."""

    async def generate(self, prompt: Prompt) -> Group:
        """Generates and scores one group; raises ``RolloutFailed``."""
        ...

    async def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        """Greedy held-out accuracy; raises ``RolloutFailed``."""
        ...

    async def version(self) -> int:
        """Policy version of the weights the engine runs."""
        ...


class TrainerClient(ObservedWorker, Protocol):
    """One data-parallel trainer shard; every shard takes part in every step."""

    async def train(self, batch: ShardBatch) -> ShardStepResult:
        """One training step (its optimizer updates); the shard resolves ``batch.groups``
        itself."""
        ...

    async def mean_cores(self) -> float:
        """Threads used, averaged over compute time (the CPU-time cross-check's cores)."""
        ...

    async def policy_weights(self, version: int) -> PolicyWeights:
        """The policy's weights, labelled ``version``, by reference (for the evaluator).
        Taken in order with training calls: exactly the weights of the last step."""
        ...

    async def save(self, out_dir: str) -> None:
        """Writes the current policy in Hugging Face format."""
        ...

    async def save_policy(self, out_dir: str) -> None:
        """Writes the policy with its tokenizer: an engine can start from the folder."""
        ...

    async def save_checkpoint(self, out_dir: str) -> None:
        """Starts writing the policy, its tokenizer and the optimizer and RNG state to
        resume from; returns once the state is snapshotted (in order with training
        calls), while the write goes on in the background."""
        ...

    async def checkpoint_written(self) -> None:
        """Returns once the last ``save_checkpoint`` is complete on disk (raises its
        error); runs beside training calls."""
        ...


class RoleStagesClient(Protocol):
    """The reference and the critic beside one trainer shard (placement "trainer"): the
    PPO dataflow's stages around the policy's update (``TrainerClient.train``), each on
    the step's data, which stays on the shard. A failure is the shard's
    (``TrainerFailed``): a dead critic is a dead trainer shard."""

    async def prepare_step(self, batch: ShardBatch) -> bool:
        """Fetches and lays out the shard's batch; True when some shard lost its groups
        (nothing is computed or trained then)."""
        ...

    async def reference_logprobs(self, step: int) -> None:
        """The frozen reference's logprobs of the step's tokens."""
        ...

    async def critic_values(self, step: int) -> None:
        """The critic's values of the step's tokens, with its current weights."""
        ...

    async def advantages(self, step: int) -> None:
        """Per-token GAE advantages and returns (whitened over every shard's tokens)."""
        ...

    async def critic_update(self, step: int) -> CriticStepResult:
        """The critic's updates on the step (it ends the step on the shard)."""
        ...


class PolicyWeights(Protocol):
    """One version's weights where an evaluator can load them (what it holds is the
    shell's own: on Ray, a reference into the object store)."""

    @property
    def version(self) -> int: ...


class Evaluator(Protocol):
    """Scores exact policy versions away from the rollout engines (run.eval_on)."""

    async def evaluate(self, prompts: Sequence[Prompt], weights: PolicyWeights) -> EvalResult:
        """Greedy held-out accuracy of ``weights``; raises ``EvaluationFailed``."""
        ...


class EvaluationFailed(Exception):
    """The evaluator could not score a version (it died, timed out or raised): the
    evaluation's row is lost, the run goes on."""


class PublishedWeights(Protocol):
    """A published version, ready to deliver (what it holds is the weight path's own)."""

    @property
    def version(self) -> int: ...


class WeightPath(Protocol):
    """Trainer shard 0's weights to every live rollout engine, one version at a time."""

    async def publish(self, version: int) -> PublishedWeights:
        """Snapshots the weights of ``version``; returns before delivery, so training
        can go on with the next step while rollout engines load."""
        ...

    async def deliver(self, published: PublishedWeights, ranks: Sequence[int]
                      ) -> tuple[list[BroadcastTiming], list[int]]:
        """Makes ``published`` the policy of the rollout workers ``ranks``; returns the
        timings of those that loaded it and the ranks that failed (each then unusable)."""
        ...


class RunFailed(Exception):
    """The run cannot go on (every rollout worker gone, restarts used up): one line."""


class WaitTimedOut(RunFailed):
    """A call to a worker got no answer in time: names what was waited for, how long."""

    def __init__(self, what: str, seconds: float, key: str) -> None:
        super().__init__(f"timed out after {seconds:g} s waiting for {what} ({key})")


class TrainerFailed(RunFailed):
    """A trainer shard's step failed. ``dead``: its process is gone or stuck, so only
    the other shards can still write the checkpoint (shards are replicas)."""

    def __init__(self, rank: int, reason: str, *, dead: bool,
                 out_of_memory: bool = False, timed_out: bool = False) -> None:
        super().__init__(f"trainer-{rank} {'died' if dead else 'failed'}: {reason}")
        self.rank = rank
        self.dead = dead
        self.out_of_memory = out_of_memory
        self.timed_out = timed_out


def all_errors(group: BaseExceptionGroup[BaseException], kind: type[E]) -> list[E]:
    """Every error of ``kind`` inside nested task-group errors."""
    found: list[E] = []
    for error in group.exceptions:
        if isinstance(error, kind):
            found.append(error)
        elif isinstance(error, BaseExceptionGroup):
            found += all_errors(error, kind)
    return found


def first_error(group: BaseExceptionGroup[BaseException],
                kinds: tuple[type[Exception], ...] = ()) -> Exception | None:
    """The first error of ``kinds`` (default: ``RunFailed``) inside nested task-group
    errors, if there is one: what the user gets as one line instead of the tree."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):  # groups are Exceptions too: look inside
            if found := first_error(error, kinds):
                return found
        elif isinstance(error, kinds or (RunFailed,)):
            return error
    return None


@dataclass
class Workers:
    """The started compute plane, as the orchestrator sees it."""

    rollout: dict[int, RolloutClient]
    """rank -> live rollout worker; retired workers are removed."""
    trainers: list[TrainerClient]
    weights: WeightPath
    evaluator: Evaluator | None = None
    """Where evaluations run with run.eval_on = "idle_cpu"; None: on rollout workers."""
    restart_rollout: Callable[[int, str, int], Awaitable[RolloutClient]] | None = None
    """Starts a new rollout worker for a rank from a model folder labelled with a
    version; None: lost workers are not replaced."""
    stages: list[RoleStagesClient] = field(default_factory=list)
    """One per trainer shard, in rank order, when the run has a reference or a critic;
    empty: GRPO's dataflow (advantages from the groups' rewards, no other role)."""
