"""The sections of the roles beside the policy: the reference, the critic, the algorithm.

Owns: ``ReferenceConfig`` ([reference]), ``CriticConfig`` ([critic]) and
``AlgorithmConfig`` ([algorithm]) with their defaults, bounds and the rules among their
own fields. The rules tying them to the trainer (a KL weight needs a reference, a critic
sits beside every trainer shard or on workers of its own) are
``async_rl.config.Config``'s. Knows nothing about
TOML or how the roles run (``workers.trainer.reference``, ``workers.trainer.critic``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from buffers.common.config import NonNegative, Positive, PositiveFloat

Placement = Literal["trainer", "own"]


class ReferenceConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The frozen reference policy the KL term (trainer.kl_coef) pulls towards."""

    path: str = ""
    """A Hugging Face model of the policy's architecture and tokenizer; "" = the
    policy's initial weights (model.path)."""
    placement: Placement = "trainer"
    """trainer: every trainer shard holds a frozen copy and runs its forward beside the
    policy's, on the same packed micro-batches. own: one worker of its own (its own
    cores or GPU) computes every shard's micro-batches and hands each shard its
    logprobs through Ray's object store."""


class AlgorithmConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where advantages come from."""

    advantage: Literal["grpo", "gae"] = "grpo"
    """grpo: each sample's reward normalised within its group (trainer.advantage_std).
    gae: per-token generalised advantage estimation with a learned critic ([critic]),
    whitened over the step (PPO; docs/algorithm.md)."""


class CriticConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The value model of algorithm.advantage = "gae"."""

    path: str = ""
    """Its initial weights: a Hugging Face model of the policy's architecture and
    tokenizer, with a fresh scalar value head; "" = the policy's initial weights."""
    num_shards: Positive = 1
    """Data-parallel critic shards. With placement "trainer" one beside each trainer
    shard, held as trainer.backend holds the policy (DDP replicas or FSDP2 shards), so it
    must equal trainer.num_shards; with "own" a DDP group of their own, each fitting the
    batches of trainer.num_shards / num_shards trainer shards (it must divide
    trainer.num_shards)."""
    placement: Placement = "trainer"
    """trainer: each critic shard lives in a trainer shard's process, on its device,
    computing on the same packed micro-batches. own: workers of its own (their own
    cores or GPUs): values and advantages there, each shard's advantages handed over
    through Ray's object store, and the critic's update running while the policy's does
    (with trainer.kl_in_reward the reference must be "own" too)."""
    lr: PositiveFloat = 1e-5
    """AdamW learning rate of the critic."""
    value_clip: Annotated[float, msgspec.Meta(ge=0)] = 0.2
    """PPO's value clip: a new value counts as at most this far from the value it had
    when the step's advantages were computed (the larger of the clipped and unclipped
    squared errors is the loss); 0 = no clip."""
    gamma: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    """Discount per policy token."""
    lam: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    """GAE's lambda: 1 = Monte-Carlo returns minus the value, 0 = one-step TD errors."""
    warmup_steps: NonNegative = 0
    """Steps that train the critic only, before the policy's first update: their
    groups fit the values and the policy's version does not move."""
    max_grad_norm: PositiveFloat = 1.0
    """The critic's gradient clipping norm."""
