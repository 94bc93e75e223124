"""Environments for multi-turn rollouts: the protocol user code implements, and its config.

Owns: ``EnvStep`` (what one ``step`` returns), ``Environment`` (the protocol: an
``async reset(row)`` giving the first prompt, an ``async step(completion)`` answering each
turn), ``EnvironmentConfig`` (the ``[task.environment]`` section: the class, the turn and
token bounds, the stop strings, the per-call deadline and what a timeout does) and
``environment_class`` (the class a config names, from a file or a module, checked to have
both methods), which raises ``ConfigError`` naming ``task.environment.class``. Knows
nothing about engines, tokens or how turns are run (``workers.rollout.turns``).

The rollout worker makes one instance per trajectory (the class is called with no
arguments), so an instance may keep the trajectory's state between its calls.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import msgspec

from buffers.common.config import ConfigError, Positive, PositiveFloat, invalid
from workers.common.user_code import absolute_target, import_object

ENV_KEY = "task.environment.class"
"""The config key every error about the environment class names."""


class EnvStep(msgspec.Struct, frozen=True):
    """The environment's answer to one turn: ``EnvStep(observation, reward, done)``, by
    position or keyword."""

    observation: str | None = None
    """Text appended to the context before the next turn (as a tool turn when the chat
    template is on); None or "" appends nothing. Its tokens are never trained."""
    reward: float = 0.0
    """This step's reward; the trajectory's reward is the sum over its steps."""
    done: bool = False
    """The trajectory ends after this step."""


class Environment(Protocol):
    """What ``[task.environment] class`` names: constructed with no arguments, once per
    trajectory."""

    async def reset(self, row: dict[str, Any]) -> str | list[dict[str, str]]:
        """The first prompt of the trajectory (a text, or chat messages) for ``row``: a
        dataset row's columns, or a built-in task's ``prompt`` and ``answer``."""
        ...

    async def step(self, completion: str) -> EnvStep:
        """Answers the policy's latest turn (its text, stop string included)."""
        ...


class EnvironmentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Multi-turn rollouts: an environment answers each turn of the policy (see
    docs/environments.md)."""

    class_: str = msgspec.field(default="", name="class")
    """The environment class: "path/to/file.py:Class" or "package.module:Class",
    constructed with no arguments once per trajectory; it has ``async reset(row)`` and
    ``async step(completion) -> async_rl.EnvStep``. "" = single-turn generation (or the
    built-in task's own environment, for a task that has one)."""
    max_turns: Positive = 4
    """Turns of the policy per trajectory at most (each one generation and one step)."""
    stop: tuple[str, ...] = ()
    """A turn's generation ends at any of these strings (kept in the text) or at EOS;
    each turn is also capped at rollout.max_new_tokens."""
    turn_timeout_s: PositiveFloat = 30.0
    """Longest one reset or step call may take; past it the trajectory ends and is
    counted (env_timeouts); task.environment.on_timeout says what becomes of it."""
    max_trajectory_tokens: Positive = 1024
    """Prompt plus every turn's completion and observation tokens: the trajectory ends
    when the next turn would have no room. It is one training sequence, so it must fit
    trainer.micro_batch_tokens. A first prompt (from reset) with no room for a turn is
    refused: that trajectory is no member of its group (counted, excluded_env_too_long)."""
    on_timeout: Literal["exclude", "train", "requeue"] = "exclude"
    """What becomes of a trajectory ended by an environment call past turn_timeout_s:
    exclude (it leaves its group's statistics and loss; a group left with fewer than two
    members runs again), train (it is scored 0 beside its group's others, by every
    reward: the task's own rewards are not called on it) or requeue
    (the whole group is dropped and its prompt runs again; ledger reason env_timeout). A
    reset that timed out gave no prompt: excluded unless requeue."""
    on_error: Literal["exclude", "train", "requeue"] = "exclude"
    """The same choices for a trajectory ended by an environment that raised (or
    returned no EnvStep); ledger reason env_error with requeue."""

    def __post_init__(self) -> None:
        if any(not s for s in self.stop):
            raise invalid("task.environment.stop", list(self.stop), "no empty stop string")

    @property
    def enabled(self) -> bool:
        """Whether rollouts are multi-turn (a class is named)."""
        return bool(self.class_)

    def absolute(self, base_dir: str | Path | None = None) -> EnvironmentConfig:
        """The config with the class's file path made absolute (another process loads
        the very same file)."""
        return msgspec.structs.replace(self, class_=absolute_target(self.class_, base_dir))


def environment_class(config: EnvironmentConfig,
                      base_dir: str | Path | None = None) -> type[Environment]:
    """The class ``config`` names, checked: a class with ``async def reset`` and ``async
    def step``; raises ``ConfigError`` naming task.environment.class."""
    cls = import_object(config.class_, ENV_KEY, base_dir=base_dir, kind="Class")

    def fail(why: str) -> ConfigError:
        return ConfigError(f"config error: {ENV_KEY} = {config.class_!r}: {why}")

    if not inspect.isclass(cls):
        raise fail(f"not a class (type {type(cls).__name__})")
    for method in ("reset", "step"):
        if not inspect.iscoroutinefunction(getattr(cls, method, None)):
            raise fail(f"needs an 'async def {method}' method")
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise fail("must be constructible with no arguments") from None
    except ValueError:  # no readable signature: constructing it will tell
        pass
    return cast("type[Environment]", cls)
