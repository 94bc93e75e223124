"""Environments for multi-turn rollouts: the protocol user code implements.

Owns: ``EnvStep`` (what one ``step`` returns) and ``Environment`` (the protocol: an
``async reset(row)`` giving the first prompt, an ``async step(completion)`` answering each
turn). Knows nothing about engines, tokens or how turns are run.

The rollout worker makes one instance per trajectory (the class is called with no
arguments), so an instance may keep the trajectory's state between its calls.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec


class EnvStep(msgspec.Struct, frozen=True):
    """The environment's answer to one turn: ``EnvStep(observation, reward, done)``, by
    position or keyword."""

    observation: str | None = None
    """Text appended to the context before the next turn; None or "" appends nothing.
    Its tokens are never trained."""
    reward: float = 0.0
    """This step's reward; the trajectory's reward is the sum over its steps."""
    done: bool = False
    """The trajectory ends after this step."""


class Environment(Protocol):
    """Constructed with no arguments, once per trajectory."""

    async def reset(self, row: dict[str, Any]) -> str | list[dict[str, str]]:
        """The first prompt of the trajectory (a text, or chat messages) for ``row``: a
        dataset row's columns, or a built-in task's ``prompt`` and ``answer``."""
        ...

    async def step(self, completion: str) -> EnvStep:
        """Answers the policy's latest turn (its text, stop string included)."""
        ...
