"""GRPO's group-normalised advantages, computed from a group's rewards (metadata only),
and DAPO's soft over-long penalty that may shape those rewards first.

Owns: ``group_advantages`` (and ``trajectory_advantages``: one per trajectory of
several segments) and its scaling choices (``AdvantageStd``,
``trainer.advantage_std``), the one test of whether a group's rewards carry any GRPO
signal (``has_signal``: rollout.filter_groups drops the groups without), and
``overlong_penalty`` (trainer.overlong = "penalty"). Knows nothing about tokens,
tensors or the loss: the control plane gives every sample its advantage before the plan
is made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageStd = Literal["sample", "population", "none"]

SIGNAL_EPS = 1e-6
"""A group whose rewards' population std is below this has no signal: zero advantages."""


def has_signal(rewards: Sequence[float], eps: float = SIGNAL_EPS) -> bool:
    """Whether the rewards differ (population std >= ``eps``): a group without signal
    gets all-zero advantages, so it teaches nothing (a group of one never has any)."""
    n = len(rewards)
    if n == 0:
        return False
    mean = sum(rewards) / n
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / n) >= eps


def group_advantages(rewards: Sequence[float], std: AdvantageStd = "sample",
                     eps: float = SIGNAL_EPS) -> list[float]:
    """(r - mean) / (std + eps) within one group (``trainer.advantage_std``).

    ``std``: "sample" (n - 1), "population" (n) or "none" (r - mean, no scaling). A group
    without signal (``has_signal``: rewards all equal, a group of one included) gets zeros.
    """
    n = len(rewards)
    if not has_signal(rewards, eps):
        return [0.0] * n
    mean = sum(rewards) / n
    deviations = [r - mean for r in rewards]
    if std == "none":
        return deviations
    squares = sum(d * d for d in deviations)
    spread = math.sqrt(squares / (n - 1 if std == "sample" else n))
    return [d / (spread + eps) for d in deviations]


def trajectory_advantages(rewards: Sequence[float], trajectories: Sequence[int],
                          std: AdvantageStd = "sample", eps: float = SIGNAL_EPS) -> list[float]:
    """Per sample, its trajectory's advantage: ``group_advantages`` over one reward per
    trajectory (its first sample's), so a trajectory of several segments counts once.
    ``trajectories``: each sample's trajectory; empty: every sample is one."""
    if not trajectories:
        return group_advantages(rewards, std, eps)
    if len(trajectories) != len(rewards):
        raise ValueError(f"{len(rewards)} rewards came with {len(trajectories)} "
                         f"trajectory indices")
    first: dict[int, int] = {}
    for i, t in enumerate(trajectories):
        first.setdefault(t, i)
    advantage = dict(zip(first, group_advantages([rewards[i] for i in first.values()],
                                                 std, eps), strict=True))
    return [advantage[t] for t in trajectories]


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft over-long punishment of a completion of ``length`` tokens, added to its
    reward: with L_max = ``max_tokens`` and L_cache = ``buffer`` (0 < buffer < max_tokens),
    0 up to L_max - L_cache, then linear down to -1 at L_max, and -1 beyond."""
    if not 0 < buffer < max_tokens:
        raise ValueError(f"overlong buffer {buffer}: must be in (0, {max_tokens})")
    free = max_tokens - buffer
    if length <= free:
        return 0.0
    if length <= max_tokens:
        return (free - length) / buffer
    return -1.0
