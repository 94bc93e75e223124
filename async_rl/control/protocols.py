"""What the orchestrator may ask of its workers: the protocols.

Owns: the orchestrator's whole view of the compute plane — a rollout worker
(``RolloutClient``), a trainer shard (``TrainerClient``), the weight path
(``WeightPath``), the evaluator beside them (``Evaluator``), what every worker reports
for the idle accounting (``ObservedWorker``) and a rollout worker's agent sessions for
the trace (``TracesSessions``), the PPO dataflow's stages on the trainer shards
(``RoleStagesClient``) and on the roles' own workers (``ReferenceClient``,
``CriticClient``; the shards take their outputs, ``RoleOutputsClient``; together
``OwnRoles``), devices that may become rollout engines while a run trains
(``EngineLending``), where groups' tokens are kept (``TokenStore``: what a checkpoint of the
queue fetches and a resume puts back) and the bundle the shell hands over (``Workers``);
what they raise is ``async_rl.control.failures``'s. Knows nothing about Ray:
``async_rl.shell.ray_shell`` adapts actor handles to these protocols, and the unit tests
pass in-process fakes, so the orchestrator's loops run the same against both.

Data moves by reference: a ``Group`` a rollout worker returns carries no tokens, only a
reference (``Group.tokens``) that the trainer shards resolve themselves.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from buffers.common.partials import PartialGroup
from buffers.common.records import Group, GroupTokens, Prompt, TokensRef
from buffers.common.reports import BroadcastTiming, CriticStepResult, EvalResult, UsageReading
from buffers.common.train_records import ShardBatch, ShardStepResult
from workers.common.spans import SessionSpan, Span


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

    async def generate(self, prompt: Prompt) -> Group | PartialGroup:
        """Generates and scores one group; raises ``RolloutFailed``. A worker that hands
        its rollouts back (``HandsBack``) returns a ``PartialGroup`` once it has."""
        ...

    async def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        """Greedy held-out accuracy; raises ``RolloutFailed``."""
        ...

    async def version(self) -> int:
        """Policy version of the weights the engine runs."""
        ...


@runtime_checkable
class TracesSessions(Protocol):
    """A rollout worker that keeps its agent sessions for the trace (the Ray shell's
    does; the simulator's runs no agents)."""

    async def sessions(self) -> list[SessionSpan]:
        """The sessions it kept since the last call, on the orchestrator's clock."""
        ...


@runtime_checkable
class HandsBack(Protocol):
    """A rollout worker that can hand its rollouts in progress back and continue those
    another handed back (the Ray shell's can; the simulator's cannot: its rollouts in
    progress at a stop run again from the start)."""

    async def continue_group(self, partial: PartialGroup) -> Group | PartialGroup:
        """Continues ``partial`` from its kept tokens and scores the group; raises
        ``RolloutFailed``."""
        ...

    async def hand_back(self) -> int:
        """Aborts the worker's sampling requests: each ``generate`` or
        ``continue_group`` in progress, and each asked for from now on, returns a
        ``PartialGroup``. Returns the groups in progress."""
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


class RoleOutput(Protocol):
    """One trainer shard's share of a role's output for a step (what it holds is the
    shell's own: on Ray, a reference into the object store, so the data goes from the
    role's worker to the shard without passing through the orchestrator)."""


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


class RoleOutputsClient(Protocol):
    """One trainer shard taking its share of the outputs of the roles on workers of
    their own (placement "own") for the step it prepared (``prepare_step``)."""

    async def take_reference(self, step: int, logprobs: RoleOutput) -> None:
        """The reference's logprobs of the shard's micro-batches, from its own worker."""
        ...

    async def take_advantages(self, step: int, advantages: RoleOutput) -> None:
        """The shard's per-token advantages, from the critic's own workers."""
        ...

    async def policy_logprobs(self, step: int) -> RoleOutput:
        """The shard's step-start policy's logprobs of its micro-batches (no gradient),
        for the KL in the reward on the critic's own workers (trainer.kl_in_reward)."""
        ...

    async def step_lost(self, step: int) -> None:
        """A role's own worker could not fetch the step's groups: nothing trains on them."""
        ...


class ReferenceClient(ObservedWorker, Protocol):
    """The frozen reference on a worker of its own (reference.placement = "own")."""

    async def mean_cores(self) -> float: ...

    async def prepare_step(self, batches: Sequence[ShardBatch]) -> bool:
        """Fetches and lays out every shard's batch; True when it lost some groups."""
        ...

    async def reference_logprobs(self, step: int) -> list[RoleOutput]:
        """The reference's logprobs of the step's tokens, one output per shard."""
        ...


class PendingCriticUpdate(Protocol):
    """A critic update under way on the critic's own worker."""

    async def result(self) -> CriticStepResult: ...


class CriticClient(ObservedWorker, Protocol):
    """One critic shard on a worker of its own (critic.placement = "own"): it holds the
    batches of trainer shards ``rank, rank + critic.num_shards, ...``."""

    async def mean_cores(self) -> float: ...

    async def prepare_step(self, batches: Sequence[ShardBatch]) -> bool:
        """Fetches and lays out its shards' batches; True when it lost some groups."""
        ...

    async def critic_values(self, step: int) -> None:
        """The critic's values of the step's tokens, with its current weights."""
        ...

    async def advantages(self, step: int, reference: Sequence[RoleOutput],
                         policy: Sequence[RoleOutput]) -> list[RoleOutput]:
        """GAE's advantages (whitened over every critic shard's tokens), one output per
        batch it holds; ``reference`` and ``policy``: the reference's and the trainer
        shards' step-start policy's logprobs of those batches (for trainer.kl_in_reward;
        empty otherwise). The returns stay for its update."""
        ...

    def start_update(self, step: int) -> PendingCriticUpdate:
        """Starts the critic's updates on the step and returns at once (they run while
        the policy's update does)."""
        ...

    async def save_checkpoint(self, out_dir: str) -> None:
        """Writes the critic's weights and optimizer state into a checkpoint's folder."""
        ...


@dataclass
class OwnRoles:
    """The roles on workers of their own (placement "own"); empty: none."""

    reference: ReferenceClient | None = None
    critics: list[CriticClient] = field(default_factory=list)
    """critic.num_shards of them, in rank order."""
    shards: list[RoleOutputsClient] = field(default_factory=list)
    """The trainer shards, in rank order, taking their share of the roles' outputs."""
    reference_to_critic: bool = False
    """The critic needs the reference's logprobs, and the shards' policy's
    (trainer.kl_in_reward)."""

    @property
    def workers(self) -> list[ReferenceClient | CriticClient]:
        return [*([self.reference] if self.reference is not None else []), *self.critics]


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


class TokenStore(Protocol):
    """Where the run keeps its groups' tokens (``Group.tokens``), as a checkpoint needs
    them: the queue's groups fetched to be written, put back when a run resumes."""

    async def fetch(self, refs: Sequence[TokensRef]) -> list[GroupTokens | None]:
        """Each reference's tokens, in order; None where they cannot be had (the rollout
        worker that kept them is gone)."""
        ...

    def put(self, tokens: GroupTokens) -> TokensRef:
        """A reference to ``tokens`` that the trainer shards resolve."""
        ...


class EngineLending(Protocol):
    """Devices ``[autopilot]``'s engine count may turn into rollout engines (ranks from
    rollout.num_workers up): the simulator's lent trainer devices
    (``async_rl.sim.lending``); real runs have none yet."""

    engines: tuple[int, int]
    """(fewest, most) rollout engines: rollout.num_workers, and with every device lent."""
    devices_per_engine: int
    trainer_devices: int
    """The trainer's devices with no engine added, each added engine taking
    ``devices_per_engine`` of them (0: spare devices, not the trainer's)."""

    async def add(self, rank: int) -> RolloutClient:
        """An engine for ``rank`` on devices not yet generating, started (switch paid)."""
        ...

    async def remove(self, rank: int) -> None:
        """``rank``'s engine, out of the pool already, gives its devices back."""
        ...


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
    own: OwnRoles = field(default_factory=OwnRoles)
    """The reference and the critic where they run on workers of their own."""
    tokens: TokenStore | None = None
    """Where the groups' tokens are kept; None: checkpoints keep no queued groups (their
    prompts are issued again on resume)."""
    lending: EngineLending | None = None
    """Devices ``[autopilot]`` may turn into rollout engines; None: the engines stay."""
