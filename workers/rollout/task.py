"""What the rollout workers and the evaluator get of the run's task (``WorkerTask``).

Owns: the record that carries the task's reward (built in, or the task's own rewards),
how its prompts are rendered and, for multi-turn tasks, its environment, into a rollout
worker's or the evaluator's constructor as one argument. Knows nothing about task kinds
or how a task is built (``async_rl.tasks.table.worker_task`` makes this record).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.rewards.function import RewardFn
from workers.rewards.runner import UserRewards
from workers.rollout.agents import AgentConfig
from workers.rollout.environment import EnvironmentConfig
from workers.rollout.prompts import PromptFormat


def named_environment(rank: int) -> None:
    """No environment of the task's own for rollout worker ``rank``: each trajectory
    builds the class task.environment names."""


@dataclass(frozen=True)
class WorkerTask:
    """What the rollout workers and the evaluator get of the task."""

    reward_fn: RewardFn
    """The built-in reward."""
    user_rewards: UserRewards | None = None
    """task.rewards and a script's callables, which replace ``reward_fn`` (they run off
    the engine's event loop, ``workers.rollout.scoring``); None: the built-in scores."""
    prompt_format: PromptFormat = field(default_factory=PromptFormat)
    """Raw text or the chat template (``workers.rollout.prompts``), the same for
    generation and greedy evaluation."""
    environment: EnvironmentConfig | None = None
    """task.environment (its file made absolute): every sample (and greedy evaluation)
    is a multi-turn trajectory (``workers.rollout.turns``); None: single-turn generation."""
    own_environment: Callable[[int], Callable[[], Any] | None] = named_environment
    """rank -> how that rollout worker builds each trajectory's environment when the
    task has its own (a built-in task's environments, made with its knobs); None: the
    class ``environment`` names, called bare."""
    agent: AgentConfig | None = None
    """task.kind = "agent": every sample (and greedy evaluation) is a trajectory the
    agent plays through the worker's gateway (``workers.rollout.agents``)."""
    model_name: str = ""
    """The name the gateway serves the policy under (model.path as configured)."""
