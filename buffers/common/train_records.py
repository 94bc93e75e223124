"""Immutable records of a trainer shard's step: the batch a shard gets for a step and
what its step answers (its loss statistics).

Owns: the shapes of ``SequenceSlot``, ``ShardBatch``, ``LossStats`` and
``ShardStepResult``; the records of prompts, samples, groups and the sequence a shard
trains (``TrainSequence``) are ``buffers.common.records``'s. Like those, every record
is a frozen msgspec Struct.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec

from buffers.common.records import GroupTokens, T, TokensRef, TrainSequence


class SequenceSlot(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One training sequence of a shard's step, by position: no tokens."""

    group: int
    """Index into the shard batch's ``groups``."""
    sample: int
    """Which sample of that group."""
    advantage: float
    reward: float = 0.0
    """The sample's training reward (what GAE starts from with a critic)."""


class ShardBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One shard's share of an optimizer step: its micro-batches, in execution order.

    Every shard of a step gets the same number of micro-batches (an empty one is a
    zero-loss pad), so DDP's collective calls line up. Sequences are slots into
    ``groups``, the references of the groups this shard trains on, which the shard
    resolves itself (``sequences``), so tokens go from the rollout worker's store
    straight to the shard that trains them.
    """

    step: int
    groups: tuple[TokensRef, ...]
    """Each group's ``GroupTokens``, or a reference the shard resolves to one."""
    micro_batches: tuple[tuple[SequenceSlot, ...], ...]
    updates: tuple[int, ...]
    """Micro-batches of each optimizer update, in order (they sum to all of them); the
    same on every shard of the step, so the shards' updates line up."""

    def sequences(self, tokens: Sequence[GroupTokens]
                  ) -> tuple[tuple[TrainSequence, ...], ...]:
        """The micro-batches' sequences, given ``groups`` resolved to ``GroupTokens``."""
        return tuple(tuple(tokens[s.group].sequence(s.sample, s.advantage, s.reward)
                           for s in mb)
                     for mb in self.micro_batches)

    def per_update(self, items: Sequence[T]) -> tuple[tuple[T, ...], ...]:
        """``items`` (one per micro-batch, in order) cut into the step's updates."""
        if len(items) != sum(self.updates):
            raise ValueError(f"{len(items)} micro-batches for updates of {self.updates}")
        ends = list(itertools.accumulate(self.updates))
        return tuple(tuple(items[end - count : end])
                     for count, end in zip(self.updates, ends, strict=True))


class LossStats(msgspec.Struct, frozen=True, kw_only=True):
    """Sums over the completion tokens of a micro-batch, a shard or a step (every token
    once per update pass that trained it); ``LossStats()`` is the empty sum."""

    tokens: int = 0
    loss_sum: float = 0.0
    """Sum of the per-token objective (before the update's aggregation)."""
    clipped: int = 0
    """Tokens where the PPO clip binds: the clipped term is the one the max takes, so no
    gradient flows through the ratio (verl's pg_clipfrac). A token masked out by
    tis_mode "mask" (weight 0) counts as neither clipped nor dual-clipped."""
    dual_clipped: int = 0
    """Tokens with a negative advantage whose loss the dual-clip bound -c * A replaced
    (verl's pg_clipfrac_lower)."""
    out_of_band: int = 0
    """Tokens whose pi_theta / pi_behaviour lies outside [1 - clip_low, 1 + clip_high]."""
    is_weight_sum: float = 0.0
    is_weight_sq_sum: float = 0.0
    is_weight_max: float = 0.0
    kl_sum: float = 0.0
    """Sum of the k3 estimator of KL(behaviour || current) per token."""
    entropy_sum: float = 0.0
    """Sum of the current policy's entropy at each trained token's position."""
    router_aux_sum: float = 0.0
    """With trainer.router_aux_coef > 0: each micro-batch's router load-balancing loss
    times its trained tokens, summed (0 otherwise)."""


class ShardStepResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one trainer shard reports after an optimizer step."""

    rank: int
    step: int
    loss: LossStats
    """Loss statistics summed over this shard's completion tokens."""
    grad_norm: float
    """The gradient norm before clipping; the largest over the step's updates."""
    forward_s: float
    backward_s: float
    optimizer_s: float
    barrier_s: float
    """Time this shard waited for slower shards before the gradient all-reduce."""
    nonfinite: bool = False
    """True when the first update's gradient was NaN/inf: it was skipped and the step
    trained nothing (its prompts run again). A later non-finite update ends the step
    early, keeping the updates before it, and shows only in ``grad_norm``."""
    input_tokens: int = 0
    """Prompt plus completion tokens of this shard's sequences (the real tokens)."""
    computed_positions: int = 0
    """Positions the model ran over for them, padding included (= ``input_tokens``
    when micro-batches are packed; pad micro-batches' dummy position not counted)."""
    samples_lost: bool = False
    """Some shard could not fetch its groups (their rollout worker died): no shard
    trained and the weights are unchanged; the step's prompts must run again."""
    kl_sum: float = 0.0
    """With a reference policy: the sum over trained tokens (every update pass) of the
    trainer.kl_estimator estimate of KL(current || reference)."""
    kl_max: float = 0.0
    """Its largest token value."""

    @property
    def padding_ratio(self) -> float:
        """Computed positions / real tokens: 1.0 is no padding."""
        return self.computed_positions / self.input_tokens if self.input_tokens else 1.0
