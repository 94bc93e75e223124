"""The environment protocol of multi-turn rollouts: what one turn's ``step`` returns.

Owns: ``EnvStep`` (an environment's answer to one turn) and ``Environment`` (the
protocol a trajectory's environment follows: ``reset(row)`` gives the first prompt,
``step(completion)`` answers each turn). Knows nothing about engines, tokens or how the
turns are run; the rollout worker drives environments, built-in tasks and users write
them.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec


class EnvStep(msgspec.Struct, frozen=True, kw_only=True):
    """An environment's answer to one turn's completion."""

    observation: str | None
    """Text appended to the context before the next turn (a tool's result); None when
    the trajectory is done."""
    reward: float
    """This turn's reward; a trajectory's reward is the sum over its turns."""
    done: bool
    """True ends the trajectory."""


class Environment(Protocol):
    """One instance per trajectory."""

    async def reset(self, row: dict[str, Any]) -> str | list[dict[str, Any]]:
        """The first prompt (text, or chat messages) of the trajectory of ``row``."""
        ...

    async def step(self, completion: str) -> EnvStep:
        """The answer to one turn's completion (the text the policy wrote this turn)."""
        ...
