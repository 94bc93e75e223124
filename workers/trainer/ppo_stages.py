"""The PPO stages' arithmetic on laid-out micro-batches, wherever the roles are placed.

Owns: one step's GAE over a list of packed micro-batches (``step_advantages``: the
outcome reward on each sequence's last policy token, minus kl_coef * KL per token with
trainer.kl_in_reward (the KL of the trainer's step-start policy, its logprobs recomputed
as verl's old logprobs are: not the engine's, whose numerics differ from the trainer's),
GAE per sequence, whitened over every shard's trained tokens),
swapping advantages into the packed rows (``with_advantages``), the critic's update over
a step cut into the policy's updates (``critic_step``: its token counts summed over every
critic shard, as the policy's loss divides), and cutting several shards' batches into
those updates at once (``merged_updates``). The critic beside a trainer shard
(``workers.trainer.shard_roles``) and the critic on workers of its own
(``workers.trainer.role_workers``) both run these, so the two placements compute the same
numbers. A step's GAE waits for the device once (its moments' read); each
micro-batch's host values reach the device in one copy that does not wait. Knows
nothing about Ray, processes or spans: collectives come in as ``sum_shards``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from buffers.common.reports import CriticStepResult
from buffers.common.train_records import ShardBatch
from workers.trainer.config import TrainerConfig
from workers.trainer.critic import Critic
from workers.trainer.gae import (
    Rows,
    from_rows,
    gae,
    moments,
    row_index,
    to_rows,
    token_rewards,
    whiten,
)
from workers.trainer.kl import kl_estimate
from workers.trainer.packing import to_device
from workers.trainer.ppo_update import Prepared
from workers.trainer.roles_config import CriticConfig

T = TypeVar("T")
Tensors = list[torch.Tensor | None]
"""One entry per micro-batch of the step; None for a pad."""
SumShards = Callable[[torch.Tensor], torch.Tensor]
"""A host tensor summed over every shard of the role (identity with one shard)."""


def _micro_batch_gae(micro_batch: Prepared, values: torch.Tensor, reference: torch.Tensor | None,
                     policy: torch.Tensor | None, *, trainer: TrainerConfig,
                     critic: CriticConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's raw advantages and returns, flat over its trained tokens."""
    assert micro_batch.packed is not None
    values = values.double()
    index, outcome = to_device(
        [row_index(micro_batch.lengths),
         torch.tensor([s.reward for s in micro_batch.sequences], dtype=torch.float64)],
        values.device)
    rows = Rows.of(micro_batch.lengths, index)
    rewards = token_rewards(outcome, rows.mask)
    if trainer.kl_in_reward and reference is not None and policy is not None:
        kl = kl_estimate(policy.double().to(values.device),
                         reference.double().to(values.device), trainer.kl_estimator)
        rewards = rewards - trainer.kl_coef * to_rows(kl, rows)
    advantages, returns = gae(rewards, to_rows(values, rows), rows.mask, gamma=critic.gamma,
                              lam=critic.lam)
    return from_rows(advantages, rows), from_rows(returns, rows).float()


def step_advantages(prepared: Sequence[Prepared], values: Tensors, reference: Tensors,
                    policy: Tensors, *, trainer: TrainerConfig, critic: CriticConfig,
                    sum_shards: SumShards) -> tuple[Tensors, Tensors]:
    """(advantages whitened over every shard's trained tokens, returns), one entry per
    micro-batch (None for a pad). ``reference`` and ``policy``: the reference's and the
    step-start policy's logprobs per micro-batch (empty without the KL in the reward),
    the policy's recomputed by the trainer, so that a policy equal to the reference
    pays no penalty for the engine's numerics. Every shard calls ``sum_shards`` once."""
    raw: Tensors = []
    returns: Tensors = []
    device_totals: torch.Tensor | None = None
    for index, mb in enumerate(prepared):
        value = values[index]
        if mb.packed is None or value is None:
            raw.append(None)
            returns.append(None)
            continue
        advantages, target = _micro_batch_gae(
            mb, value, reference[index] if reference else None,
            policy[index] if policy else None, trainer=trainer, critic=critic)
        raw.append(advantages)
        returns.append(target)
        part = moments(advantages)
        device_totals = part if device_totals is None else device_totals + part
    # The step's one read of the device: every micro-batch's moments at once.
    totals = sum_shards(torch.zeros(3, dtype=torch.float64) if device_totals is None
                        else device_totals.cpu())
    return [None if a is None else whiten(a, totals).float() for a in raw], returns


def with_advantages(prepared: Sequence[Prepared], advantages: Sequence[torch.Tensor | None]
                    ) -> list[Prepared]:
    """``prepared`` with each packed row's per-token advantages replaced (on its device)."""
    return [mb if a is None or mb.packed is None
            else dataclasses.replace(mb, packed=dataclasses.replace(
                mb.packed, advantages=a.to(mb.packed.advantages.device)))
            for mb, a in zip(prepared, advantages, strict=True)]


def merged_updates(batches: Sequence[ShardBatch], items: Sequence[Sequence[T]]
                   ) -> tuple[tuple[T, ...], ...]:
    """Per optimizer update, the items (one per micro-batch of each batch, ``items[i]``
    for ``batches[i]``) of every batch's share of it, batch after batch: every shard's
    batch is cut into the same updates, so one critic shard can fit several."""
    cuts = [batch.per_update(list(per_batch))
            for batch, per_batch in zip(batches, items, strict=True)]
    return tuple(tuple(item for cut in cuts for item in cut[update])
                 for update in range(len(cuts[0]) if cuts else 0))


def critic_step(critic: Critic, step: int, updates: Sequence[Sequence[Prepared]],
                values: Sequence[Sequence[torch.Tensor | None]],
                returns: Sequence[Sequence[torch.Tensor | None]], sum_shards: SumShards
                ) -> CriticStepResult:
    """The critic's updates on a step cut into ``updates``, towards ``returns``, clipped
    around ``values`` (what the advantages came from); each update's loss divides by its
    trained tokens over every critic shard."""
    counts = torch.tensor([sum(sum(mb.lengths) for mb in update) for update in updates],
                          dtype=torch.long)
    tokens = [int(c) for c in sum_shards(counts).tolist()]
    return critic.update(step, updates, values, returns, tokens)
