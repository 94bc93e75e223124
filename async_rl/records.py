"""Immutable records that cross a process or stage boundary.

Owns: the shapes of prompts, generated samples, scored groups, weight broadcast timings and
per-step metrics. Knows nothing about how they are produced or moved: every record is a
frozen msgspec Struct, so it round-trips through msgpack (Ray, files) unchanged, and a
stage that changes one makes a new record with ``msgspec.structs.replace``.
"""

from __future__ import annotations

import msgspec


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """One task prompt with the reference answer its reward function checks against."""

    prompt_id: str
    """Unique, stable id (source name + cursor index); the ledger keys on it."""
    text: str
    """The prompt text handed to the tokenizer."""
    answer: str
    """Reference answer, as text; the reward function parses it."""
    attempt: int = 0
    """How many times this prompt was re-queued after a staleness drop or a failure."""


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One generated completion of a prompt, as the behaviour policy produced it."""

    token_ids: tuple[int, ...]
    """Completion token ids (the prompt's are on the Group)."""
    logprobs: tuple[float, ...]
    """Behaviour log-probability of each completion token, from the rollout engine."""
    versions: tuple[int, ...]
    """Policy version that produced each completion token (in-flight updates mix them)."""
    finish_reason: str
    """Why generation stopped: "stop", "length" or "abort"."""
    text: str
    """Decoded completion text, for the reward function and for logs."""
    reward: float = 0.0
    """Scalar reward of this completion."""
    reward_failed: bool = False
    """True when the reward function raised; the reward is then 0."""

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else 0

    @property
    def max_version(self) -> int:
        return max(self.versions) if self.versions else 0


class Group(msgspec.Struct, frozen=True, kw_only=True):
    """All samples of one prompt, scored: the unit the replay queue stores and trains."""

    prompt: Prompt
    """The prompt the samples answer."""
    prompt_token_ids: tuple[int, ...]
    """Tokenised prompt, shared by every sample."""
    samples: tuple[Sample, ...]
    """The group's completions, each with its reward."""
    min_version: int
    """Oldest policy version of any token in the group (staleness is measured from it)."""
    max_version: int
    """Newest policy version of any token in the group."""
    num_tokens: int
    """Prompt plus completion tokens over all samples: the group's bucket key and cost."""
    rollout_rank: int = 0
    """Which rollout worker produced the group."""
    finished_at: float = 0.0
    """Wall-clock time (time.time()) when the last sample finished."""

    @property
    def prompt_id(self) -> str:
        return self.prompt.prompt_id

    @property
    def rewards(self) -> tuple[float, ...]:
        return tuple(s.reward for s in self.samples)

    @property
    def sequence_lengths(self) -> tuple[int, ...]:
        """Length (prompt + completion) of each sample's training sequence."""
        n_prompt = len(self.prompt_token_ids)
        return tuple(n_prompt + len(s.token_ids) for s in self.samples)


def make_group(
    prompt: Prompt,
    prompt_token_ids: tuple[int, ...],
    samples: tuple[Sample, ...],
    *,
    rollout_rank: int = 0,
    finished_at: float = 0.0,
) -> Group:
    """Builds a Group, deriving its version range and token count from the samples."""
    if not samples:
        raise ValueError(f"group for prompt {prompt.prompt_id!r} has no samples")
    n_prompt = len(prompt_token_ids)
    return Group(
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        samples=samples,
        min_version=min(s.min_version for s in samples),
        max_version=max(s.max_version for s in samples),
        num_tokens=sum(n_prompt + len(s.token_ids) for s in samples),
        rollout_rank=rollout_rank,
        finished_at=finished_at,
    )


class BroadcastTiming(msgspec.Struct, frozen=True, kw_only=True):
    """How long one rollout worker took to take up one weight version, split by phase.

    The engine stood still (paused, nothing sampled) for ``transfer_s + load_s``."""

    version: int
    rollout_rank: int
    publish_s: float
    """Trainer side: snapshotting the weights of the version (once for all workers)."""
    transfer_s: float
    """Engine paused, moving the tensors in: the weight-transfer backend's receive calls,
    each bucket loaded into the model as it arrives."""
    pause_s: float
    """Until the engine was paused (in-flight: keep, near 0; drain: waiting for the
    running requests)."""
    load_s: float
    """Engine paused, the rest: preparing and finishing the reload, relabelling,
    resuming, and the calls between those steps."""


class EvalResult(msgspec.Struct, frozen=True, kw_only=True):
    """One greedy held-out evaluation, as the rollout worker that ran it reports it."""

    accuracy: float
    """Mean reward of one greedy completion per held-out prompt."""
    version_min: int
    """Oldest policy version of any scored token: an in-flight weight update during the
    evaluation makes later tokens carry the newer version."""
    version_max: int
    """Newest policy version of any scored token (= version_min unless an update landed)."""
    num_prompts: int
    rollout_rank: int
    seconds: float
    """How long the evaluation took on the worker."""


class LedgerEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One event in a prompt's life; the run's ledger is a JSONL of these."""

    prompt_id: str
    event: str
    """admitted | generated | trained | dropped | requeued | failed"""
    version: int
    """Policy version current when the event happened."""
    attempt: int = 0
    reason: str = ""
    """Why a prompt was dropped or failed (e.g. "stale", "rollout_error")."""
    time: float = 0.0


class TrainSequence(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One sample as the trainer sees it: tokens, behaviour logprobs and its advantage."""

    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    advantage: float


class ShardBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One shard's share of an optimizer step: its micro-batches, in execution order.

    Every shard of a step gets the same number of micro-batches (an empty one is a
    zero-loss pad), so DDP's collective calls line up.
    """

    step: int
    micro_batches: tuple[tuple[TrainSequence, ...], ...]


class LossStats(msgspec.Struct, frozen=True, kw_only=True):
    """Sums over the completion tokens of a micro-batch, a shard or a step."""

    tokens: int
    loss_sum: float
    clipped: int
    """Tokens whose pi_theta / pi_behaviour lies outside the clip range."""
    is_weight_sum: float
    is_weight_sq_sum: float
    is_weight_max: float
    kl_sum: float
    """Sum of the k3 estimator of KL(behaviour || current) per token."""


class ShardStepResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one trainer shard reports after an optimizer step."""

    rank: int
    step: int
    loss: LossStats
    """Loss statistics summed over this shard's completion tokens."""
    grad_norm: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    barrier_s: float
    """Time this shard waited for slower shards before the gradient all-reduce."""
    nonfinite: bool = False
    """True when the loss or gradient was NaN/inf and the update was skipped."""
    input_tokens: int = 0
    """Prompt plus completion tokens of this shard's sequences (the real tokens)."""
    computed_positions: int = 0
    """Positions the model ran over for them, padding included (= ``input_tokens``
    when micro-batches are packed; pad micro-batches' dummy position not counted)."""

    @property
    def padding_ratio(self) -> float:
        """Computed positions / real tokens: 1.0 is no padding."""
        return self.computed_positions / self.input_tokens if self.input_tokens else 1.0


class RolloutStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of one rollout worker since it was created."""

    rank: int
    version: int
    """Policy version of the weights now in the engine."""
    groups_generated: int
    samples_generated: int
    tokens_generated: int
    """Completion tokens of finished group samples (not evaluation)."""
    reward_failures: int
    """Completions whose reward function raised or returned a non-finite value."""
    weight_updates: int
    requests_running: int
    """Sample requests submitted to the engine and not finished."""
    tokens_in_flight: int
    """Tokens generated so far by the requests still running."""
    engine_start_s: float
    """Seconds ``start()`` took to build and warm up the engine (0 before it ran)."""
    warmup_s: float
    """Of which the warm-up requests took this many."""
