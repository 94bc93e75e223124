"""From a step's groups to per-shard work: advantages and the plan, made from metadata.

Owns: giving every sample its group-normalised advantage, cutting the step into
``trainer.mini_batches`` mini-batches of whole groups (one optimizer update each), and
laying the samples out as the balancing plan says, as slots (group, sample, advantage)
into each shard's list of group references. Knows nothing about Ray or torch and never
sees a token: lengths and rewards are on the ``Group`` metadata; the shards resolve the
references themselves. The plan comes from ``buffers.balance``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from buffers.advantages import group_advantages
from buffers.balance import StepPlan, plan_step
from buffers.records import Group, SequenceSlot, ShardBatch
from workers.trainer.config import TrainerConfig


def shard_batches(
    groups: Sequence[Group], num_shards: int, trainer: TrainerConfig, step: int
) -> tuple[list[ShardBatch], StepPlan]:
    """The per-shard batches of one optimizer step and the plan that laid them out.

    A shard's batch lists only the groups it trains on, in first-use order.
    """
    # Every sample in group order: (group index, sample index, advantage, length).
    samples = [
        (g, k, advantage, length)
        for g, group in enumerate(groups)
        for k, (advantage, length) in enumerate(
            zip(group_advantages(group.rewards, trainer.advantage_std),
                group.sequence_lengths, strict=True))
    ]
    # Mini-batches: consecutive runs of whole groups, one optimizer update each.
    chunks = np.array_split(np.arange(len(groups)),
                            max(1, min(trainer.mini_batches, len(groups))))
    plan = plan_step(
        [length for *_, length in samples],
        num_shards=num_shards,
        cap=trainer.micro_batch_tokens,
        cost_a=trainer.cost_a,
        cost_b=trainer.cost_b,
        updates=[sum(groups[int(g)].num_samples for g in chunk) for chunk in chunks],
    )
    batches = []
    for shard in plan.shards:
        local: dict[int, int] = {}  # step group index -> index in this shard's groups
        micro_batches = []
        for micro_batch in shard.micro_batches:
            slots = []
            for i in micro_batch:
                g, k, advantage, _ = samples[i]
                slots.append(SequenceSlot(group=local.setdefault(g, len(local)), sample=k,
                                          advantage=advantage))
            micro_batches.append(tuple(slots))
        batches.append(ShardBatch(step=step, groups=tuple(groups[g].tokens for g in local),
                                  micro_batches=tuple(micro_batches), updates=plan.updates))
    return batches, plan
