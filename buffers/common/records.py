"""Immutable records that cross a process or stage boundary.

Owns: the shapes of prompts, generated samples, scored groups, weight broadcast timings and
per-step metrics. Knows nothing about how they are produced or moved: every record is a
frozen msgspec Struct, so it round-trips through msgpack (Ray, files) unchanged, and a
stage that changes one makes a new record with ``msgspec.structs.replace``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

import msgspec
import numpy as np
from numpy.typing import NDArray

T = TypeVar("T")

NO_VERSION = -1
"""The version of a token no policy wrote (an environment's observation, a chat
template's turn markers): it has loss mask 0 and no behaviour logprob, and version
ranges and staleness skip it."""

NO_POLICY_TOKEN = "no_policy_token"
"""Why a member is excluded: the policy wrote none of its tokens (every reset of its
environment failed, or its first prompt left no room for a turn)."""
REWARD_FAILED = "reward_failed"
"""Why a member is excluded: its reward call raised, returned a non-finite value or
ran past its deadline (task.on_reward_failure = "exclude")."""


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
    messages: tuple[dict[str, str], ...] = ()
    """The prompt as chat messages (``{"role", "content"}``) when its dataset column holds
    a conversation; empty for a text prompt (``text`` is then the whole prompt)."""
    columns: dict[str, Any] = {}
    """The row's other dataset columns (JSON-able values), handed to the task's own
    rewards beside ``answer``; empty for the built-in tasks."""
    data_source: str = ""
    """verl's ``data_source`` for a row without that column (the dataset's name)."""


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One generated completion of a prompt, as the behaviour policy produced it."""

    token_ids: tuple[int, ...]
    """Completion token ids (the prompt's are on the group's GroupTokens)."""
    logprobs: tuple[float, ...]
    """Behaviour log-probability of each completion token, from the rollout engine."""
    versions: tuple[int, ...]
    """Policy version that produced each completion token (in-flight updates mix them);
    ``NO_VERSION`` for a token the policy did not write."""
    finish_reason: str
    """Why generation stopped: "stop", "length" or "abort"."""
    text: str
    """Decoded completion text, for the reward function and for logs."""
    reward: float = 0.0
    """Scalar reward of this completion."""
    reward_failed: bool = False
    """True when the reward function raised; the reward is then 0."""
    loss_mask: tuple[int, ...] = ()
    """Per completion token: 1 written by the policy (trained), 0 not (a multi-turn
    trajectory's observation and template tokens, whose logprob is 0 and version
    ``NO_VERSION``). Empty: every token is the policy's (a single-turn sample)."""
    env_outcome: str = ""
    """How a multi-turn trajectory ended: "done", "max_turns", "max_tokens", "timeout"
    (an environment call past task.environment.turn_timeout_s) or "error" (the
    environment raised); "" for a single-turn sample."""
    excluded: str = ""
    """Why this trajectory is not a member of its group ("" = it is one): an environment
    failure that task.environment.on_error / on_timeout exclude ("env_error",
    "env_timeout"), a first prompt too long to answer ("env_too_long"). ``make_group``
    adds ``NO_POLICY_TOKEN`` and ``REWARD_FAILED``."""
    longest_turn: int = -1
    """Policy tokens of the trajectory's longest turn, what rollout.max_new_tokens caps
    (-1: a single-turn sample, whose whole completion is its one turn)."""
    messages: tuple[dict[str, str], ...] = ()
    """A multi-turn trajectory as its parts: each policy turn's text (role "assistant")
    and each observation (role "tool"), in order, as TRL-style rewards get it; empty for
    a single-turn sample."""
    trajectory: int = -1
    """Which trajectory of its group this sample is a segment of, when a trajectory can
    give several training sequences (an agent that rewrote its history: each segment
    is one sample, all with the trajectory's reward and advantage); -1: the sample is a
    trajectory of its own."""

    @property
    def min_version(self) -> int:
        """Oldest version of a policy-written token (``NO_VERSION`` when there is none)."""
        return min((v for v in self.versions if v != NO_VERSION), default=NO_VERSION)

    @property
    def max_version(self) -> int:
        return max((v for v in self.versions if v != NO_VERSION), default=NO_VERSION)

    @property
    def exclusion(self) -> str:
        """Why this sample cannot be a group member ("" = it can): its own ``excluded``,
        else no policy-written token, else a lost reward score."""
        if self.excluded:
            return self.excluded
        if all(v == NO_VERSION for v in self.versions):
            return NO_POLICY_TOKEN
        return REWARD_FAILED if self.reward_failed else ""


class GroupTokens(msgspec.Struct, frozen=True, kw_only=True):
    """A group's token arrays: the only record that carries tokens past a rollout worker.

    Under Ray it sits in the object store (put there by the rollout actor) and only the
    trainer shards that train its samples fetch it; the orchestrator holds a reference.
    Arrays, not per-token lists: Ray moves numpy buffers without pickling each element.
    """

    prompt_token_ids: NDArray[np.int32]
    """Tokenised prompt, shared by every sample."""
    completion_token_ids: NDArray[np.int32]
    """Every sample's completion ids, end to end (sample i is ``offsets[i]:offsets[i+1]``)."""
    logprobs: NDArray[np.float32]
    """Behaviour log-probability of each completion token, aligned with the ids."""
    versions: NDArray[np.int32]
    """Policy version that produced each completion token (``NO_VERSION``: none did)."""
    offsets: NDArray[np.int64]
    """``num_samples + 1`` cumulative completion lengths, starting at 0."""
    loss_mask: NDArray[np.int8] | None = None
    """Per completion token, aligned with the ids: 1 trained (the policy wrote it), 0
    context only (an observation or template token). None: every token is trained."""

    def sequence(self, sample: int, advantage: float, reward: float = 0.0) -> TrainSequence:
        """Sample ``sample`` as the trainer sees it (views, not copies)."""
        span = slice(int(self.offsets[sample]), int(self.offsets[sample + 1]))
        mask = None if self.loss_mask is None else self.loss_mask[span]
        return TrainSequence(prompt_token_ids=self.prompt_token_ids,
                             completion_token_ids=self.completion_token_ids[span],
                             behaviour_logprobs=self.logprobs[span], advantage=advantage,
                             reward=reward, loss_mask=None if mask is None or mask.all() else mask)


TokensRef: TypeAlias = Any
"""Where a group's ``GroupTokens`` are kept: in a run, a Ray object-store reference to
them (put there by the rollout worker that generated the group, fetched by the trainer
shard that trains on it); in the tests and the simulator, the ``GroupTokens`` themselves
(or None: no tokens at all). ``Any`` to the type checker, since buffers/ never imports
ray; only the trainer shard resolves one (``workers.trainer``)."""


class Group(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt's scored samples, as metadata: the unit the queue, gate and plan see.

    No tokens: ``tokens`` refers to the group's ``GroupTokens`` (an object-store
    reference under Ray, the record itself in-process), and the queue, the staleness
    rules and the balancing plan need only lengths, versions and rewards.
    """

    prompt: Prompt
    """The prompt the samples answer."""
    prompt_length: int
    """Prompt tokens, shared by every sample."""
    completion_lengths: tuple[int, ...]
    """Completion tokens of each sample."""
    rewards: tuple[float, ...]
    """Scalar reward of each sample."""
    finish_reasons: tuple[str, ...]
    """Why each sample stopped: "stop", "length" (hit max_new_tokens) or "abort"."""
    reward_failures: int = 0
    """Scores lost to a reward call that raised or returned a non-finite value (they
    count 0)."""
    reward_timeouts: int = 0
    """Scores lost to a reward call past task.reward_timeout_s (they count 0)."""
    reward_pool_saturated: int = 0
    """Of ``reward_timeouts``, the scores whose call was refused at once: every reward
    thread was stuck in an earlier call (task.reward_threads)."""
    reward_scores: dict[str, tuple[float | None, ...]] = {}
    """Per reward of the task's own (task.rewards), and per extra metric ``<name>/<key>``
    of a verl-style one: each sample's value, unweighted; None where there is none (an
    excluded sample, never scored; a lost score; a metric the sample did not give). The
    step's reward/<name> averages the members' values that are not None."""
    env_timeouts: int = 0
    """Multi-turn trajectories ended by an environment call past
    task.environment.turn_timeout_s."""
    env_errors: int = 0
    """Multi-turn trajectories ended by an environment that raised."""
    gateway_refused: int = 0
    """Requests of the group's agent sessions that the gateway refused (bad JSON, an
    unknown model, an over-long prompt, a turn past task.max_turns...)."""
    excluded: tuple[str, ...] = ()
    """Per sample: why it is not a member of the group ("" = it is; empty: every sample
    is). An excluded sample is no zero-reward member: it leaves the advantages, the
    group filter, the loss and the statistics; only its tokens stay in ``tokens``."""
    longest_turns: tuple[int, ...] = ()
    """Per sample: policy tokens of its longest turn, what rollout.max_new_tokens caps
    (empty: single-turn samples, each one turn of ``completion_lengths``)."""
    trajectories: tuple[int, ...] = ()
    """Per sample: the trajectory it is a segment of (``Sample.trajectory``); empty:
    every sample is a trajectory of its own. Advantages and the member rule count
    trajectories, not samples."""
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
    tokens: TokensRef = None
    """Where the group's ``GroupTokens`` are: a reference only a trainer shard resolves."""

    @property
    def prompt_id(self) -> str:
        return self.prompt.prompt_id

    @property
    def num_samples(self) -> int:
        return len(self.completion_lengths)

    @property
    def sequence_lengths(self) -> tuple[int, ...]:
        """Length (prompt + completion) of each sample's training sequence."""
        return tuple(self.prompt_length + n for n in self.completion_lengths)

    @property
    def members(self) -> tuple[int, ...]:
        """Indices of the samples that are members of the group (not ``excluded``)."""
        if not self.excluded:
            return tuple(range(self.num_samples))
        return tuple(k for k, why in enumerate(self.excluded) if not why)

    @property
    def member_trajectories(self) -> int:
        """How many trajectories have a member sample (segments of one count once)."""
        if not self.trajectories:
            return len(self.members)
        return len({self.trajectories[k] for k in self.members})

    @property
    def member_rewards(self) -> tuple[float, ...]:
        """The members' rewards, in order (the excluded samples' left out)."""
        return tuple(self.rewards[k] for k in self.members)

    @property
    def turn_lengths(self) -> tuple[int, ...]:
        """Per sample: the tokens rollout.max_new_tokens capped (its longest turn)."""
        return self.longest_turns or self.completion_lengths


def make_group(
    prompt: Prompt,
    prompt_token_ids: Sequence[int],
    samples: Sequence[Sample],
    *,
    rollout_rank: int = 0,
    finished_at: float = 0.0,
    reward_failures: int | None = None,
    reward_timeouts: int = 0,
    reward_pool_saturated: int = 0,
    reward_scores: Mapping[str, tuple[float | None, ...]] | None = None,
    gateway_refused: int = 0,
) -> Group:
    """A Group holding its own ``GroupTokens`` (the rollout actor swaps in a reference),
    with its version range, lengths and token count derived from the samples
    (``reward_failures``: by default the samples flagged ``reward_failed``).

    Each sample's ``Sample.exclusion`` becomes its entry of ``Group.excluded``. The
    version range covers the samples with a policy token; with none it is
    ``NO_VERSION`` (such a group has no member and is never queued)."""
    if not samples:
        raise ValueError(f"group for prompt {prompt.prompt_id!r} has no samples")
    lengths = tuple(len(s.token_ids) for s in samples)
    masked = any(s.loss_mask for s in samples)
    versions = [(s.min_version, s.max_version) for s in samples if s.min_version != NO_VERSION]
    excluded = tuple(s.exclusion for s in samples)
    tokens = GroupTokens(
        prompt_token_ids=np.asarray(prompt_token_ids, dtype=np.int32),
        completion_token_ids=np.fromiter(
            itertools.chain.from_iterable(s.token_ids for s in samples), np.int32),
        logprobs=np.fromiter(itertools.chain.from_iterable(s.logprobs for s in samples),
                             np.float32),
        versions=np.fromiter(itertools.chain.from_iterable(s.versions for s in samples),
                             np.int32),
        offsets=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]),
        loss_mask=np.fromiter(itertools.chain.from_iterable(
            s.loss_mask or (1,) * len(s.token_ids) for s in samples), np.int8)
        if masked else None,
    )
    return Group(
        prompt=prompt,
        prompt_length=len(prompt_token_ids),
        completion_lengths=lengths,
        rewards=tuple(s.reward for s in samples),
        finish_reasons=tuple(s.finish_reason for s in samples),
        reward_failures=(sum(s.reward_failed for s in samples) if reward_failures is None
                         else reward_failures),
        reward_timeouts=reward_timeouts,
        reward_pool_saturated=reward_pool_saturated,
        reward_scores=dict(reward_scores or {}),
        min_version=min((low for low, _ in versions), default=NO_VERSION),
        max_version=max((high for _, high in versions), default=NO_VERSION),
        env_timeouts=sum(s.env_outcome == "timeout" for s in samples),
        env_errors=sum(s.env_outcome == "error" for s in samples),
        gateway_refused=gateway_refused,
        excluded=excluded if any(excluded) else (),
        longest_turns=(tuple(len(s.token_ids) if s.longest_turn < 0 else s.longest_turn
                             for s in samples)
                       if any(s.longest_turn >= 0 for s in samples) else ()),
        trajectories=(tuple(s.trajectory for s in samples)
                      if any(s.trajectory >= 0 for s in samples) else ()),
        num_tokens=sum(lengths) + len(prompt_token_ids) * len(samples),
        rollout_rank=rollout_rank,
        finished_at=finished_at,
        tokens=tokens,
    )


class TrainSequence(msgspec.Struct, frozen=True, kw_only=True):
    """One sample as the trainer sees it: token arrays, behaviour logprobs, its advantage.

    Built inside a trainer shard from fetched ``GroupTokens``; never sent anywhere.
    """

    prompt_token_ids: NDArray[np.int32]
    completion_token_ids: NDArray[np.int32]
    behaviour_logprobs: NDArray[np.float32]
    advantage: float
    reward: float = 0.0
    """The reward its advantage came from (with a critic, GAE lays it on the last
    policy token)."""
    loss_mask: NDArray[np.int8] | None = None
    """1 per trained completion token, 0 per context-only one (an observation); None:
    all trained. Only trained tokens get a loss term, a statistic and a normaliser count;
    the others are context (``workers.trainer.packing``)."""

    @property
    def trained_tokens(self) -> int:
        """Completion tokens with a loss term."""
        if self.loss_mask is None:
            return len(self.completion_token_ids)
        return int(np.count_nonzero(self.loss_mask))
