"""The GRPO token loss: the off-policy PPO formula and its normalisation.

Owns: the token-loss formula (``token_loss``), how an update's token losses are
aggregated (``Normaliser``), and a micro-batch's statistics kept on the device until a
step reads them all in one host read (``PendingStats``, ``read_stats``). Advantages are
``buffers.plan.advantages``'; adding shards' statistics and summarising them is
``async_rl.control.loss_stats``'. Knows nothing about
batching, devices or distribution: callers pass flat token tensors and the counts every
shard agreed on, and sum the returned loss across micro-batches and shards.

Per token, with advantage A, clip band [1 - clip_low, 1 + clip_high] and dual-clip c:

    ppo(r)  = max(-A * r, -A * clip(r))          PPO-clip, as a loss
    loss(r) = min(ppo(r), -A * c)  if A < 0      dual-clip (verl, AReaL)
              ppo(r)               otherwise

Two forms, chosen by ``tis_cap``:
- decoupled (tis_cap > 0, the default; AReaL's decoupled PPO): r = pi_theta / pi_prox,
  where the proximal policy pi_prox is the trainer's policy at the start of the step
  (its logprobs computed once, without gradient, before any update), and the per-token
  loss is multiplied by the detached behaviour weight w = pi_prox / pi_behaviour, capped
  at tis_cap (``tis_mode``: truncated to the cap, or the token masked out). With one
  update per step the proximal policy is the current one, so r = 1 in value and the
  loss is -w * A (the truncated-IS policy gradient).
- plain (tis_cap = 0): PPO-clip with the rollout engine's behaviour logprobs as the old
  policy, r = pi_theta / pi_behaviour, no weight.

Every log-ratio is clamped to +-20 before ``exp``, so a token 100 nats off-policy gives a
finite loss and gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from buffers.common.train_records import LossStats
from workers.trainer.config import LossAgg, TrainerConfig

LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to +-this before ``exp`` (verl's bound): exp(20) ~ 5e8."""


class Normaliser(msgspec.Struct, frozen=True, kw_only=True):
    """What one update's token losses are divided by (``trainer.loss_agg``).

    Built from counts every shard agreed on before the update, so the losses of every
    micro-batch on every shard add up to the update's loss however tokens were split.
    """

    agg: LossAgg
    """``trainer.loss_agg``."""
    tokens: int
    """Completion tokens in the update, over all shards."""
    sequences: int
    """Sequences in the update, over all shards."""
    max_response_tokens: int = 1
    """The constant seq_mean_token_sum_norm divides each sequence's token sum by
    (rollout.max_new_tokens)."""

    def aggregate(self, per_token: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """This micro-batch's share of the update loss; ``lengths`` are its sequences'
        completion lengths, in token order."""
        if self.agg == "token_mean":
            return per_token.sum() / max(self.tokens, 1)
        if self.agg == "seq_mean_token_mean":
            counts = torch.tensor(lengths, dtype=torch.long)
            if per_token.device.type == "cuda":  # a pageable copy would wait for the device
                counts = counts.pin_memory()
            counts = counts.to(per_token.device, non_blocking=True)
            per_sequence = 1.0 / counts.clamp(min=1).to(per_token.dtype)
            # output_size: without it repeat_interleave reads the total back from the device.
            per_token = per_token * torch.repeat_interleave(per_sequence, counts,
                                                            output_size=per_token.numel())
            return per_token.sum() / max(self.sequences, 1)
        return per_token.sum() / (max(self.sequences, 1) * self.max_response_tokens)


_SUMMED = ("loss_sum", "clipped", "dual_clipped", "out_of_band", "is_weight_sum",
           "is_weight_sq_sum", "kl_sum", "entropy_sum", "router_aux_sum")
"""``PendingStats.values``' fields that add up over micro-batches; the last value is
``is_weight_max``."""
_COUNTED = frozenset({"clipped", "dual_clipped", "out_of_band"})


@dataclass(frozen=True, slots=True)
class PendingStats:
    """A micro-batch's ``LossStats`` while still on the device (reading each one would
    stop the host from queuing work ahead of the GPU)."""

    tokens: int
    """Trained tokens (known on the host)."""
    values: torch.Tensor
    """float64 ``(10,)``: the ``_SUMMED`` fields, then ``is_weight_max``."""


def read_stats(parts: Sequence[PendingStats]) -> LossStats:
    """The micro-batches' statistics added up (the weight's maximum taken), in one host
    read."""
    if not parts:
        return LossStats()
    values = torch.stack([p.values for p in parts])
    host = torch.cat([values[:, :-1].sum(0), values[:, -1:].amax(0)]).tolist()
    fields = dict(zip((*_SUMMED, "is_weight_max"), host, strict=True))
    return LossStats(tokens=sum(p.tokens for p in parts),
                     **{k: round(v) if k in _COUNTED else v for k, v in fields.items()})


def _exp_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def _term(weight: torch.Tensor | None, ratio: torch.Tensor | float,
          advantages: torch.Tensor) -> torch.Tensor:
    """-(w * ratio * A), or -(ratio * A) without a weight: one term of the loss."""
    return -(ratio * advantages) if weight is None else -(weight * ratio * advantages)


def token_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    lengths: Sequence[int],
    norm: Normaliser,
    config: TrainerConfig,
    proximal_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    router_aux: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PendingStats]:
    """This micro-batch's share of an update's loss, and its statistics (on the device:
    ``read_stats`` reads them).

    The tensors are 1-D over the same completion tokens, sequence after sequence
    (``lengths``). ``proximal_logprobs``: the step-start policy's logprobs (decoupled
    form); None means the current policy detached, exact when the update is the step's
    only one (it skips a forward pass). ``entropy``: the policy's entropy per token, for
    the statistics only. ``router_aux``: the micro-batch's router load-balancing loss
    (a scalar), for the statistics only (times its tokens: ``router_aux_sum``).
    """
    decoupled = config.tis_cap > 0
    if not decoupled:
        reference = behaviour_logprobs
    elif proximal_logprobs is None:
        reference = logprobs.detach()
    else:
        reference = proximal_logprobs
    with torch.no_grad():
        behaviour_log_ratio = (logprobs - behaviour_logprobs).clamp(
            -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        behaviour_ratio = torch.exp(behaviour_log_ratio)
        weight: torch.Tensor | None = None
        if decoupled:
            # Without proximal logprobs the reference is the current policy, so the
            # weight is the behaviour ratio just computed.
            weight = (behaviour_ratio if proximal_logprobs is None
                      else _exp_ratio(reference - behaviour_logprobs))
            if config.tis_mode == "truncate":
                weight = torch.clamp(weight, max=config.tis_cap)
            else:
                weight = torch.where(weight <= config.tis_cap, weight, 0.0)
    ratio = _exp_ratio(logprobs - reference)
    clipped_ratio = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    # The weight goes inside each term, in this order, so that with one update (r = 1)
    # loss and gradient are bit for bit the previous -(w * r * A).
    unclipped_loss = _term(weight, ratio, advantages)
    clipped_loss = _term(weight, clipped_ratio, advantages)
    ppo = torch.maximum(unclipped_loss, clipped_loss)
    bound = _term(weight, config.clip_ratio_c, advantages)
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(ppo, bound), ppo)
    if weight is None:
        weight = behaviour_ratio  # for the statistics: the plain form's IS ratio
    loss = norm.aggregate(per_token, lengths)
    with torch.no_grad():
        out_of_band = ((behaviour_ratio < 1.0 - config.clip_low)
                       | (behaviour_ratio > 1.0 + config.clip_high))
        # k3 estimator of KL(behaviour || current) on behaviour samples: r - 1 - log r
        # with r = pi_theta / pi_behaviour (unbiased, never negative).
        k3 = behaviour_ratio - 1.0 - behaviour_log_ratio
        zero = per_token.new_zeros(())
        summed = (per_token.sum(), (clipped_loss > unclipped_loss).sum(),
                  (negative & (ppo > bound)).sum(), out_of_band.sum(), weight.sum(),
                  (weight * weight).sum(), k3.sum(),
                  entropy.sum() if entropy is not None else zero,
                  router_aux.detach() * logprobs.numel() if router_aux is not None else zero,
                  weight.amax() if weight.numel() else zero)
        stats = PendingStats(tokens=int(logprobs.numel()),
                             values=torch.stack([v.double() for v in summed]))
    return loss, stats


