"""From a step's groups to per-shard micro-batches: advantages, plan, data moved once.

Owns: flattening groups into training sequences with group-normalised advantages and
laying them out as the balancing plan says. Knows nothing about Ray or torch; the plan
itself comes from ``buffers.balance`` and is made from lengths only.
"""

from __future__ import annotations

from collections.abc import Sequence

from async_rl.config import TrainerConfig
from async_rl.grpo import group_advantages
from async_rl.records import Group, ShardBatch, TrainSequence
from buffers.balance import StepPlan, plan_step


def training_sequences(groups: Sequence[Group]) -> list[TrainSequence]:
    """Every sample of every group, with its advantage, in group order."""
    sequences: list[TrainSequence] = []
    for group in groups:
        advantages = group_advantages(group.rewards)
        for sample, advantage in zip(group.samples, advantages, strict=True):
            sequences.append(
                TrainSequence(
                    prompt_token_ids=group.prompt_token_ids,
                    completion_token_ids=sample.token_ids,
                    behaviour_logprobs=sample.logprobs,
                    advantage=advantage,
                )
            )
    return sequences


def shard_batches(
    groups: Sequence[Group], num_shards: int, trainer: TrainerConfig, step: int
) -> tuple[list[ShardBatch], StepPlan]:
    """The per-shard batches of one optimizer step and the plan that laid them out."""
    sequences = training_sequences(groups)
    lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in sequences]
    plan = plan_step(
        lengths,
        num_shards=num_shards,
        cap=trainer.micro_batch_tokens,
        cost_a=trainer.cost_a,
        cost_b=trainer.cost_b,
    )
    batches = [
        ShardBatch(
            step=step,
            micro_batches=tuple(
                tuple(sequences[i] for i in micro_batch) for micro_batch in shard.micro_batches
            ),
        )
        for shard in plan.shards
    ]
    return batches, plan
