"""The reward protocol the rollout worker and the evaluator score completions with.

Owns: ``RewardFn`` (a plain function ``(prompt, completion_text) -> float``, passed in by
the application) and calling one so that a failure scores nothing instead of raising
(``guarded_reward``). The built-in tasks' rewards are ``async_rl.tasks.rewards``'.
Knows nothing about tokens, engines or groups.
"""

from __future__ import annotations

import math
from typing import Protocol

from buffers.common.records import Prompt


class RewardFn(Protocol):
    """Scores one completion of ``prompt``; must be pure and cheap (it runs per sample)."""

    def __call__(self, prompt: Prompt, completion_text: str) -> float: ...


def guarded_reward(reward_fn: RewardFn, prompt: Prompt, text: str) -> float | None:
    """``reward_fn``'s finite score, or None when it raised or was not finite: a buggy
    reward or a pathological completion must not take a run down (callers score 0 and
    count it)."""
    try:
        reward = float(reward_fn(prompt, text))
    except Exception:
        return None
    return reward if math.isfinite(reward) else None
