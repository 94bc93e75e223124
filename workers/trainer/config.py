"""The trainer section: the knobs of the torch trainer shards and the GRPO loss.

Owns: ``TrainerConfig``, its defaults, bounds and the rules among its own fields, and the
choice types the loss reads (``AdvantageStd``, ``LossAgg``). Knows nothing about TOML or
the other sections.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from buffers.common.config import NonNegative, Positive, PositiveFloat, invalid
from buffers.plan.advantages import AdvantageStd

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
Overlong = Literal["keep", "mask", "penalty"]
Backend = Literal["ddp", "fsdp2"]
FsdpDtype = Literal["model", "float32", "bfloat16"]
KlEstimator = Literal["k1", "k2", "k3"]


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The torch trainer shards and the GRPO loss."""

    num_shards: Positive = 1
    """Data-parallel trainer shards (gloo on CPU, NCCL on CUDA)."""
    backend: Backend = "ddp"
    """How the shards hold the model. ddp: every shard a full replica (parameters,
    gradients and AdamW state: 16 bytes a parameter in fp32), gradients all-reduced.
    fsdp2: torch's FSDP2 (``fully_shard`` on every decoder layer and the root), each shard
    holding 1/num_shards of them; the model is built on the meta device and loaded shard
    by shard, so no shard ever holds the whole model (docs/fsdp.md says when to choose
    which). Checkpoints of one backend do not resume with the other."""
    shard_group: NonNegative = 0
    """fsdp2 only: shards per FSDP group. 0 (or num_shards): one group, every shard holds
    1/num_shards of the model. Fewer: hybrid sharding (HSDP), num_shards / shard_group
    groups that each hold the whole model in 1/shard_group slices and replicate each
    other (gradients reduce-scattered within a group, all-reduced across groups): the
    device mesh is (num_shards / shard_group, shard_group), so it must divide num_shards."""
    param_dtype: FsdpDtype = "model"
    """fsdp2 only: dtype of the gathered parameters forward and backward compute with
    (FSDP2's MixedPrecisionPolicy); the sharded master weights and AdamW state stay in
    model.dtype. model: no cast. bfloat16 with model.dtype float32 is mixed precision
    (bf16 compute, fp32 master)."""
    reduce_dtype: FsdpDtype = "model"
    """fsdp2 only: dtype gradients are reduce-scattered in (MixedPrecisionPolicy). model:
    param_dtype's (no cast); float32 keeps bf16 compute's gradient sums exact-ish."""
    offload: bool = False
    """fsdp2 only: keep the parameter shards, gradients and AdamW state in CPU memory
    (FSDP2's CPUOffloadPolicy, pinned where an accelerator exists), copied to the
    device layer by layer: less device memory, slower steps. On a CPU-only machine it
    changes little."""
    groups_per_step: Positive = 8
    """Groups consumed by one training step (one policy version: mini_batches * epochs
    optimizer updates, one by default)."""
    micro_batch_tokens: Positive = 4096
    """Hard cap on the tokens in one micro-batch (first-fit-decreasing packing)."""
    lr: PositiveFloat = 1e-4
    """AdamW learning rate."""
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """AdamW weight decay."""
    max_grad_norm: PositiveFloat = 1.0
    """Gradient clipping norm."""
    clip_low: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.2
    """PPO clip: the ratio's lower bound is 1 - clip_low (the ratio is pi_theta /
    pi_proximal, or pi_theta / pi_behaviour when tis_cap = 0)."""
    clip_high: PositiveFloat = 0.28
    """PPO clip: the ratio's upper bound is 1 + clip_high (DAPO's clip-higher: a
    low-probability token may rise further than a likely one may fall)."""
    clip_ratio_c: Annotated[float, msgspec.Meta(gt=1)] = 3.0
    """Dual-clip bound c (> 1): for a negative advantage the per-token loss is at most
    -c * A, so a token whose ratio ran far above 1 cannot blow up the step (verl's
    clip_ratio_c; 3.0 is its default)."""
    tis_cap: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    """Cap C on the behaviour importance weight pi_proximal / pi_behaviour (decoupled
    PPO, ``workers.trainer.loss``); 0 = no proximal policy: plain PPO-clip against the
    behaviour logprobs."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """What a behaviour weight above tis_cap does. truncate: it counts as tis_cap (TIS;
    every token keeps a gradient, the default since a rare far-off token still teaches);
    mask: the token contributes nothing (AReaL's default; its tokens still count in the
    normaliser)."""
    mini_batches: Positive = 1
    """Optimizer updates per pass over a step's data: the step's groups are cut into
    this many consecutive mini-batches of whole groups (must divide groups_per_step),
    each one update. 1 = one update per step (the default: the cheapest, no proximal
    forward pass)."""
    epochs: Positive = 1
    """Passes over a step's mini-batches (each mini-batch is an update in every pass).
    With mini_batches * epochs > 1 the proximal logprobs come from one extra no-grad
    forward at step start, and the PPO clip bounds how far the later updates move."""
    advantage_std: AdvantageStd = "sample"
    """How group rewards are scaled: (r - mean) / (std + eps) with the sample std (n - 1,
    as verl, AReaL and TRL), the population std (n), or "none": r - mean (Dr. GRPO: no
    scaling, so groups with a small reward spread are not amplified)."""
    loss_agg: LossAgg = "token_mean"
    """How per-token losses become the update's loss (verl's modes). token_mean: sum over
    every token / tokens of the update (the default: every token weighs the same, long
    answers are not down-weighted; DAPO). seq_mean_token_mean: each sequence's token mean,
    averaged over sequences (the original GRPO). seq_mean_token_sum_norm: each sequence's
    token sum / rollout.max_new_tokens, averaged over sequences (Dr. GRPO). Every count
    is global: all micro-batches and all shards of the update."""
    overlong: Overlong = "keep"
    """Completions cut at rollout.max_new_tokens (finish_reason "length"). keep: trained
    like any other. mask: DAPO's overlong filtering: no loss on them (they are left out
    of the step's micro-batches, so their tokens are neither trained nor counted in the
    loss normaliser), though their rewards still count in their group's advantages.
    penalty: DAPO's soft overlong punishment, added to every completion's reward before
    advantages (and before rollout.filter_groups looks at them): 0 up to
    max_new_tokens - overlong_buffer tokens, then falling linearly to -1 at
    max_new_tokens."""
    overlong_buffer: NonNegative = 0
    """DAPO's L_cache: the last this many tokens before rollout.max_new_tokens over which
    trainer.overlong = "penalty" falls from 0 to -1; required there (1 to max_new_tokens
    - 1), unused otherwise."""
    cost_a: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """Balancing cost per token (cost = a*L + b*L^2)."""
    cost_b: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Balancing cost per squared token (attention's quadratic term)."""
    cpus_per_shard: Positive = 1
    """Cores each trainer shard owns (torch threads)."""
    step_timeout_s: PositiveFloat = 900.0
    """Longest one shard's optimizer step may take; past it the shard counts as stuck
    and the run stops with a checkpoint from a live shard (if any)."""
    max_nonfinite_steps: Positive = 3
    """Steps in a row with a non-finite gradient (each trains nothing and runs its
    prompts again) before the run stops with a checkpoint: a diverged run is loud."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Precision of the trainer's matmuls (torch autocast over forward and backward).
    Weights, gradients, optimizer state and the loss stay in model.dtype. bfloat16 makes
    a CPU step with AVX-512 bf16 about 1.5-2x faster, at the price of logprobs that
    differ from the engine's by bf16 rounding (the truncated IS weight absorbs it).
    float32 on CUDA runs its matmuls in TF32 (10-bit mantissa products, float32 sums),
    switched on for each trainer-side process as a whole on purpose: a trainer shard's,
    or a reference's or critic's worker of its own, runs nothing but this compute."""

    kl_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Weight of the KL term to the reference policy ([reference]); > 0 builds one. 0
    with reference.path set measures the KL (kl/mean, kl/max) without penalising it."""
    kl_estimator: KlEstimator = "k3"
    """Schulman's estimator of KL(policy || reference) per token: k1 (log-ratio), k2
    (half its square) or k3 (verl's low_var_kl; docs/algorithm.md)."""
    kl_in_reward: bool = False
    """true: -kl_coef * KL per token folded into the reward before GAE (PPO style; needs
    algorithm.advantage = "gae"); false: kl_coef * KL a term of the loss (GRPO style)."""
    router_aux_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Mixture-of-experts policies: weight of the model's own router load-balancing loss
    (transformers' ``load_balancing_loss_func`` over every layer's router logits, the
    Switch Transformer's auxiliary loss) added to the policy loss; 0 (the default) adds
    nothing and computes nothing. Each micro-batch's value is computed over its packed
    row (real tokens only: a packed row has no padding) and weighs as its share of the
    update's trained tokens; the step's token-weighted mean is logged as router_aux.
    Needs trainer.packed and a model with routers."""
    packed: bool = True
    """One padding-free row per micro-batch, attention kept per sequence
    (``workers.trainer.packing``); false runs the padded reference layout, slower, for
    comparisons (bench/trainer/packing.py)."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile each decoder layer (dynamic shapes: one graph for every micro-batch
    length and sequence count). auto: on where the packed attention is one varlen flash
    call per layer (CUDA with bfloat16 compute, or fsdp2 with param_dtype bfloat16);
    off on the CPU (compiling costs minutes for little), for float32 compute on CUDA
    and for the padded layout. The per-sequence attention loop (CPU, float32) is never
    compiled: true there compiles the rest of each layer around it. The first step pays
    the compile (logged once)."""

    def __post_init__(self) -> None:
        if self.backend != "fsdp2":
            for key, value, default in (("offload", self.offload, False),
                                        ("shard_group", self.shard_group, 0),
                                        ("param_dtype", self.param_dtype, "model"),
                                        ("reduce_dtype", self.reduce_dtype, "model")):
                if value != default:
                    raise invalid(f"trainer.{key}", value,
                                  f'needs trainer.backend = "fsdp2" (it is {self.backend!r})')
        if self.shard_group and self.num_shards % self.shard_group:
            raise invalid("trainer.shard_group", self.shard_group,
                          f"must divide trainer.num_shards ({self.num_shards}): the mesh "
                          "is (num_shards / shard_group, shard_group)")
        if self.router_aux_coef and not self.packed:
            raise invalid("trainer.router_aux_coef", self.router_aux_coef,
                          "needs trainer.packed = true (the padded layout has no router loss)")
        if self.groups_per_step % self.mini_batches:
            raise invalid(
                "trainer.mini_batches",
                self.mini_batches,
                f"must divide trainer.groups_per_step ({self.groups_per_step}): "
                "every mini-batch holds the same number of whole groups",
            )
