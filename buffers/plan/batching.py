"""From a step's groups to per-shard work: advantages and the plan, made from metadata.

Owns: which samples are a group's members (``Group.members``; task.on_reward_failure =
"zero" takes lost scores back in, ``with_reward_failures``), the rewards advantages are
computed from (``training_rewards``: the members' rewards, plus DAPO's over-long penalty
with trainer.overlong = "penalty", on each member's longest policy turn, what
rollout.max_new_tokens caps; the group filter of rollout.filter_groups judges the same
ones), which members are trained (``trained_sample``: trainer.overlong = "mask" leaves
out those with a turn cut at max_new_tokens), giving every member its group-normalised
advantage (a trajectory of several segments, an agent's, counts once: each of its
segments gets its advantage), cutting the step into
``trainer.mini_batches`` mini-batches of whole groups (one optimizer update each), and
laying the samples out as the balancing plan says, as slots (group, sample, advantage,
training reward: a critic's GAE starts from it)
into each shard's list of group references. Knows nothing about Ray or torch and never
sees a token: lengths and rewards are on the ``Group`` metadata; the shards resolve the
references themselves. The plan comes from ``buffers.plan.balance``; its costs and token cap
count a multi-turn trajectory's every token, observations included, as the forward pass
computes them all (only the loss skips the tokens the policy did not write).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec
import numpy as np

from buffers.common.records import REWARD_FAILED, Group
from buffers.common.train_records import SequenceSlot, ShardBatch
from buffers.plan.advantages import AdvantageStd, overlong_penalty, trajectory_advantages
from buffers.plan.balance import StepPlan, plan_step


class TrainerRules(Protocol):
    """The trainer.* keys batching reads, as ``workers.trainer.config.TrainerConfig``
    holds them: the data plane names what it needs and imports nothing above it."""

    @property
    def overlong(self) -> str: ...
    @property
    def overlong_buffer(self) -> int: ...
    @property
    def advantage_std(self) -> AdvantageStd: ...
    @property
    def mini_batches(self) -> int: ...
    @property
    def micro_batch_tokens(self) -> int: ...
    @property
    def cost_a(self) -> float: ...
    @property
    def cost_b(self) -> float: ...


def with_reward_failures(group: Group) -> Group:
    """``group`` with the samples whose score was lost taken back in as members
    (task.on_reward_failure = "zero": they count with reward 0)."""
    if REWARD_FAILED not in group.excluded:
        return group
    excluded = tuple("" if why == REWARD_FAILED else why for why in group.excluded)
    return msgspec.structs.replace(group, excluded=excluded if any(excluded) else ())


def training_rewards(group: Group, trainer: TrainerRules,
                     max_new_tokens: int | None = None) -> list[float]:
    """The rewards the group's advantages are computed from, one per member
    (``Group.members``, in order): its reward, plus ``overlong_penalty`` of its longest
    policy turn with trainer.overlong = "penalty" (``max_new_tokens``,
    rollout.max_new_tokens, is needed then; observations never count)."""
    members = group.members
    if trainer.overlong != "penalty":
        return [group.rewards[k] for k in members]
    if max_new_tokens is None:
        raise ValueError('trainer.overlong = "penalty" needs rollout.max_new_tokens')
    turns = group.turn_lengths
    return [group.rewards[k] + overlong_penalty(turns[k], max_new_tokens,
                                                trainer.overlong_buffer)
            for k in members]


def trained_sample(group: Group, sample: int, trainer: TrainerRules) -> bool:
    """Whether a member gets a loss: not with trainer.overlong = "mask" when one of its
    turns was cut at max_new_tokens (finish reason "length")."""
    return trainer.overlong != "mask" or group.finish_reasons[sample] != "length"


def shard_batches(
    groups: Sequence[Group], num_shards: int, trainer: TrainerRules, step: int,
    *, max_new_tokens: int | None = None,
) -> tuple[list[ShardBatch], StepPlan]:
    """The per-shard batches of one optimizer step and the plan that laid them out
    (``max_new_tokens``: rollout.max_new_tokens, for trainer.overlong = "penalty").

    A shard's batch lists only the groups it trains on, in first-use order. Only members
    are trained (an excluded sample is in no batch and in no advantage); a member
    ``trained_sample`` leaves out is in no batch (its reward still counted in its
    group's advantages); a step may then train fewer samples, or none.
    """
    # Which members get a loss, and the rewards their group's advantages come from.
    losses = [[trained_sample(group, k, trainer) for k in group.members] for group in groups]
    rewards = [training_rewards(group, trainer, max_new_tokens) for group in groups]
    # Every trained member in group order: (group index, sample index, advantage,
    # reward, length).
    samples = [
        (g, k, advantage, reward, group.sequence_lengths[k])
        for g, group in enumerate(groups)
        for k, advantage, reward, trained in zip(
            group.members, trajectory_advantages(
                rewards[g], [group.trajectories[k] for k in group.members]
                if group.trajectories else (), trainer.advantage_std),
            rewards[g], losses[g], strict=True)
        if trained
    ]
    # Mini-batches: consecutive runs of whole groups, one optimizer update each.
    chunks = np.array_split(np.arange(len(groups)),
                            max(1, min(trainer.mini_batches, len(groups))))
    trained = [sum(members) for members in losses]
    plan = plan_step(
        [length for *_, length in samples],
        num_shards=num_shards,
        cap=trainer.micro_batch_tokens,
        cost_a=trainer.cost_a,
        cost_b=trainer.cost_b,
        updates=[sum(trained[int(g)] for g in chunk) for chunk in chunks],
    )
    batches = []
    for shard in plan.shards:
        local: dict[int, int] = {}  # step group index -> index in this shard's groups
        micro_batches = []
        for micro_batch in shard.micro_batches:
            slots = []
            for i in micro_batch:
                g, k, advantage, reward, _ = samples[i]
                slots.append(SequenceSlot(group=local.setdefault(g, len(local)), sample=k,
                                          advantage=advantage, reward=reward))
            micro_batches.append(tuple(slots))
        batches.append(ShardBatch(step=step, groups=tuple(groups[g].tokens for g in local),
                                  micro_batches=tuple(micro_batches), updates=plan.updates))
    return batches, plan
