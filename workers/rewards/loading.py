"""The rewards a runner is given, loaded and checked in the caller, before any pool starts.

Owns: ``RewardLike`` (what ``workers.rewards.runner.RewardRunner`` takes as a reward),
``LoadedReward`` (one of them loaded: its function, weight, name and style),
``load_rewards`` (every one loaded, a spec's file path made absolute, and checked: a bad
one raises before a worker starts) and ``final_names`` (their metric names: given ones
must not clash, derived ones are made unique). Knows nothing about how rewards are
called or where they run (``workers.rewards.runner``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from buffers.common.config import ConfigError
from workers.rewards.callables import Reward
from workers.rewards.spec import (
    RewardSpec,
    Style,
    absolute_spec,
    check_reward,
    load_reward,
    reward_name,
    reward_style,
    unique_names,
)

RewardLike = RewardSpec | Reward | Callable[..., Any]
"""A reward as the runner takes it: a config entry, a script's ``Reward``, or the
function itself."""


class LoadedReward(NamedTuple):
    """One reward loaded: its spec is None where it was passed as a callable."""

    fn: Callable[..., Any]
    spec: RewardSpec | None
    weight: float
    name: str
    style: Style


def load_rewards(rewards: Sequence[RewardLike], styles: Sequence[str],
                 columns: Collection[str],
                 base_dir: str | Path | None) -> list[LoadedReward]:
    """Each reward loaded (a spec, by file path made absolute) and checked."""
    loaded = []
    for i, (reward, forced) in enumerate(zip(rewards, styles, strict=True)):
        if isinstance(reward, RewardSpec):
            spec = absolute_spec(reward, base_dir)
            if forced:
                spec = msgspec.structs.replace(spec, style=forced)
            fn = load_reward(spec, index=i, columns=columns)
            loaded.append(LoadedReward(fn, spec, spec.weight, spec.name,
                                       reward_style(fn, spec.style)))
        elif isinstance(reward, Reward) or callable(reward):
            given = reward if isinstance(reward, Reward) else Reward(fn=reward)
            style = reward_style(given.fn, forced or given.style)
            why = check_reward(given.fn, style, columns)
            if why:
                raise TypeError(f"reward {i} ({reward_name(given.fn)}): {why}")
            loaded.append(LoadedReward(given.fn, None, given.weight, given.name, style))
        else:
            raise TypeError(f"reward {i} is a {type(reward).__name__}: expected a "
                            "RewardSpec, a Reward or a callable")
    return loaded


def final_names(loaded: Sequence[LoadedReward], names: Sequence[str]) -> list[str]:
    """The metric names: given ones (which must not clash), else derived and unique."""
    given = [name or item.name for item, name in zip(loaded, names, strict=True)]
    first: dict[str, int] = {}
    for i, name in enumerate(given):
        if name in first:
            raise ConfigError(f"config error: task.rewards[{i}].name = {name!r}: already "
                              f"the name of task.rewards[{first[name]}]")
        if name:
            first[name] = i
    return unique_names([reward_name(item.fn) for item in loaded], given)
