"""Reward functions passed as Python objects (a script's), not named in a config.

Owns: ``Reward`` (a callable with its weight, metric name and style: the Python API's
twin of a ``[[task.rewards]]`` entry, ``workers.rewards.spec.RewardSpec``, which pickles
its function with ``dumps``), ``dumps`` (a callable pickled for another process, by
value when it is user code) and
``check_function`` (one ``Reward`` checked before anything starts: it can take a
completion in its style and can be sent to the workers), which raises ``ConfigError``
with one line naming ``rewards[i]``. Knows nothing about how rewards are called.
"""

from __future__ import annotations

import functools
import inspect
import math
import pickle
import sysconfig
from collections.abc import Callable, Collection
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import msgspec

from buffers.common.config import ConfigError
from workers.common.errors import first_line
from workers.rewards.spec import DEFAULT_COLUMNS, STYLES, check_reward, reward_name, reward_style


class Reward(msgspec.Struct, frozen=True, kw_only=True):
    """A reward function from a script, as ``async_rl.train(config, rewards=[...])``
    takes it (a bare callable there means ``Reward(fn=it)``)."""

    fn: Callable[..., Any]
    """The function, or a callable object: sync or ``async def``. It travels to the
    workers pickled, by value when it comes from your own code (a script, a test
    module, a module beside them), so a worker need not be able to import it."""
    weight: float = 1.0
    """Its weight in the sum of the rewards that is a sample's reward."""
    name: str = ""
    """Its metric name (``reward/<name>``); empty = the function's name, made unique."""
    style: Literal["", "trl", "verl", "sample"] = ""
    """How it is called ("trl", "verl" or "sample"); empty = guessed from its parameters."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickled, (dumps(self.fn), self.weight, self.name, self.style))


def _unpickled(fn: bytes, weight: float, name: str, style: Any) -> Reward:
    return Reward(fn=pickle.loads(fn), weight=weight, name=name, style=style)


_INSTALLED = tuple({Path(sysconfig.get_paths()[key]).resolve()
                    for key in ("stdlib", "platstdlib", "purelib", "platlib")})


def _own_module(fn: Callable[..., Any]) -> ModuleType | None:
    """The module ``fn`` (a function, class, callable object or partial) was defined in,
    when that is user code rather than the standard library or an installed package."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    target = fn if inspect.isroutine(fn) or inspect.isclass(fn) else type(fn)
    module = inspect.getmodule(target)
    file = getattr(module, "__file__", None)
    if module is None or file is None or module.__name__ == "__main__":
        return None  # builtins; __main__ goes by value anyway
    path = Path(file).resolve()
    return None if any(path.is_relative_to(root) for root in _INSTALLED) else module


def dumps(fn: Callable[..., Any]) -> bytes:
    """``fn`` pickled for another process: with cloudpickle where installed (by value for
    user code, whose module another process or node may not import), else pickle."""
    try:
        import cloudpickle  # ray ships it: functions of __main__, closures and lambdas too
    except ImportError:
        return pickle.dumps(fn)
    module = _own_module(fn)
    if module is None or module.__name__ in cloudpickle.list_registry_pickle_by_value():
        return bytes(cloudpickle.dumps(fn))
    cloudpickle.register_pickle_by_value(module)
    try:
        return bytes(cloudpickle.dumps(fn))
    finally:
        cloudpickle.unregister_pickle_by_value(module)


def check_function(reward: Reward, *, index: int = 0,
                   columns: Collection[str] = DEFAULT_COLUMNS) -> None:
    """Raises ``ConfigError`` naming ``rewards[index]`` when ``reward`` cannot score: not
    callable, a weight that is not finite, an unknown style, parameters no style and no
    dataset column (``columns``) provides, or a function that does not pickle."""
    fn = reward.fn
    if not callable(fn):
        raise ConfigError(f"config error: rewards[{index}] = {fn!r}: not callable "
                          f"(type {type(fn).__name__})")
    key = f"config error: rewards[{index}] ({reward_name(fn)})"
    if not math.isfinite(reward.weight):
        raise ConfigError(f"{key}: weight = {reward.weight!r}: must be a finite number")
    try:
        style = reward_style(fn, reward.style)
    except ValueError:
        raise ConfigError(f"{key}: style = {reward.style!r}: expected one of "
                          f"{', '.join(repr(s) for s in STYLES)}") from None
    why = check_reward(fn, style, columns)
    if why:
        raise ConfigError(f"{key}: {why}")
    try:
        dumps(fn)
    except Exception as err:
        raise ConfigError(f"{key}: cannot be sent to the workers ({first_line(err)}); "
                          "define it at module level") from None
