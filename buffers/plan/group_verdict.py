"""Whether a generated group goes on to the replay queue, and if not, why.

Owns: the rules that judge a group as it comes back from a rollout worker
(``GroupRules``: the task's, the environment's and the group filter's keys, named here
so that the data plane imports nothing above it) and the judgement (``group_verdict``):
with task.on_reward_failure = "zero" the samples whose score was lost count with reward
0; an environment timeout or error with on_timeout / on_error = "requeue", or fewer than
two members (no GRPO group: nothing to compare a member with), runs its prompt again;
with rollout.filter_groups, a group whose training rewards (``training_rewards``) are all
equal has no signal and is dropped for good (DAPO's dynamic sampling). Knows nothing
about the ledger, the gate or the workers: the caller acts on the verdict.
"""

from __future__ import annotations

import msgspec

from buffers.common.records import Group
from buffers.plan.advantages import has_signal
from buffers.plan.batching import TrainerRules, training_rewards, with_reward_failures

ENV_TIMEOUT = "env_timeout"
ENV_ERROR = "env_error"
TOO_FEW_MEMBERS = "too_few_members"


class GroupRules(msgspec.Struct, frozen=True, kw_only=True):
    """The keys that judge a generated group."""

    trainer: TrainerRules
    """How advantages see rewards (the filter judges the same rewards)."""
    max_new_tokens: int | None = None
    """rollout.max_new_tokens (trainer.overlong = "penalty" needs it)."""
    zero_reward_failures: bool = False
    """task.on_reward_failure = "zero"."""
    requeue_env_timeouts: bool = False
    """task.environment.on_timeout = "requeue"."""
    requeue_env_errors: bool = False
    """task.environment.on_error = "requeue"."""
    filter_groups: bool = False
    """rollout.filter_groups is on."""


class GroupVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """What becomes of one generated group."""

    group: Group
    """The group as it goes on (its lost scores taken back in on request)."""
    requeue: str = ""
    """Why its prompt runs again (``ENV_TIMEOUT``, ``ENV_ERROR``, ``TOO_FEW_MEMBERS``);
    "": it does not."""
    informative: bool | None = None
    """rollout.filter_groups' judgement (False: filtered); None: not judged."""

    @property
    def queued(self) -> bool:
        """The group goes on to the replay queue."""
        return not self.requeue and self.informative is not False


def group_verdict(group: Group, rules: GroupRules) -> GroupVerdict:
    """The verdict on ``group`` under ``rules``; see the module docstring."""
    if rules.zero_reward_failures:
        group = with_reward_failures(group)
    if group.env_timeouts and rules.requeue_env_timeouts:
        return GroupVerdict(group=group, requeue=ENV_TIMEOUT)
    if group.env_errors and rules.requeue_env_errors:
        return GroupVerdict(group=group, requeue=ENV_ERROR)
    if group.member_trajectories < 2:
        return GroupVerdict(group=group, requeue=TOO_FEW_MEMBERS)
    if not rules.filter_groups:
        return GroupVerdict(group=group)
    rewards = training_rewards(group, rules.trainer, rules.max_new_tokens)
    return GroupVerdict(group=group, informative=has_signal(rewards))
