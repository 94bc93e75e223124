"""What workers and the prompt ledger report: a weight update's timing per phase, a
greedy evaluation's result, a rollout worker's counters, a worker's OS usage reading, one
event of a prompt's life, a critic shard's update.

Owns: those records' shapes. Knows nothing about how they are measured or written; like
``buffers.common.records`` (the data the queue and the trainer move), every one is a frozen
msgspec Struct that round-trips through msgpack unchanged.
"""

from __future__ import annotations

import msgspec


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
    bytes: int = 0
    """The version's size as sent (its snapshot on the source shard): the whole policy,
    or with LoRA its adapters only."""


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
    """admitted | generated | trained | dropped | requeued | failed | unfinished |
    restored (a queued group back in a resumed run's queue from its checkpoint)"""
    version: int
    """Policy version current when the event happened."""
    attempt: int = 0
    reason: str = ""
    """Why a prompt was dropped or failed (e.g. "stale", "rollout_error"); a drop with
    reason "filtered" (rollout.filter_groups) is final: the prompt is not run again."""
    time: float = 0.0
    rewards: tuple[float, ...] = ()
    """The group's members' rewards (``Group.member_rewards``: an excluded sample's left
    out), on its trained and filtered events."""
    lengths: tuple[int, ...] = ()
    """Completion tokens of each sample, on its generated events (what
    ``async-rl simulate --lengths RUN_DIR`` replays); the tokens kept per sample on a
    partial rollout's handed_back, partial_restored and admitted (reason "continue")
    events."""


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
    rewards_skipped: int
    """Samples no reward was called on: no group member, or a trajectory an environment
    failure ended (scored 0 without a call)."""
    weight_updates: int
    requests_running: int
    """Sample requests submitted to the engine and not finished."""
    tokens_in_flight: int
    """Tokens generated so far by the requests still running (counted as they come only
    when the worker streams tokens, ``stream_tokens``; otherwise 0 until they finish)."""
    engine_start_s: float
    """Seconds ``start()`` took to build and warm up the engine (0 before it ran)."""
    warmup_s: float
    """Of which the warm-up requests took this many."""


class UsageReading(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's cumulative OS counters at one moment; two readings give a busy fraction."""

    wall: float
    """time.time() of the reading."""
    cpu_s: float
    """User + system CPU seconds of this process and all its descendants."""
    gpu_util_sum: float = 0.0
    """Sum of NVML utilisation samples (percent) so far; 0 without CUDA."""
    gpu_samples: int = 0


class CriticStepResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one critic shard reports after its update of a step (sums over its trained
    tokens, every update pass)."""

    rank: int
    step: int
    tokens: int = 0
    value_loss_sum: float = 0.0
    """Sum of the per-token clipped value loss, 0.5 * max((V - R)^2, (V_clip - R)^2)."""
    clipped: int = 0
    """Tokens where the clipped term is the larger (the value clip binds)."""
    value_sum: float = 0.0
    """Sum of the values the step's advantages were computed from."""
    return_sum: float = 0.0
    """Sum of the returns (the critic's targets)."""
    grad_norm: float = 0.0
    """The largest gradient norm (before clipping) over the step's updates."""
    seconds: float = 0.0
    """Time the update took (forward, backward and optimizer)."""
    samples_lost: bool = False
    """Some shard could not fetch its groups: no update was made."""
