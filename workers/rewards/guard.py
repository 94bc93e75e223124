"""One reward call that never raises: the guarded calls, and the process workers' side.

Owns: ``CallFailed`` (a call that gave no values: why, and whether it timed out),
``guarded`` and ``guarded_async`` (one ``score_group`` call, its exception or, for async
rewards, its timeout turned into a ``CallFailed``), ``describe`` (an exception as one
line) and what a reward process runs: ``child_init`` (pebble's initializer: load the
rewards once) and ``child_score`` (one call there). Pickled by reference into those
processes, so it stays light: no pool, no event loop of its own
(``workers.rewards.runner``).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from workers.common.errors import first_line
from workers.common.user_code import import_user_file
from workers.rewards.calls import RewardValues, score_group, score_group_async
from workers.rewards.spec import RewardSpec, Style, import_reward


class CallFailed(msgspec.Struct, frozen=True):
    """A reward call that gave no values: why, and whether it ran out of time."""

    message: str
    timed_out: bool = False


def describe(err: BaseException) -> str:
    """One line: the exception, its first line of text and where in user code it rose."""
    text = first_line(err)
    frames = traceback.extract_tb(err.__traceback__)
    return f"{text} (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" \
        if frames else text


def guarded(fn: Callable[..., Any], style: Style,
            inputs: Mapping[str, Any]) -> RewardValues | CallFailed:
    """``score_group(fn, style, **inputs)``, or why it failed."""
    try:
        return score_group(fn, style, **inputs)
    except Exception as err:
        return CallFailed(describe(err))


async def guarded_async(fn: Callable[..., Any], style: Style, inputs: Mapping[str, Any],
                        timeout_s: float) -> RewardValues | CallFailed:
    """``score_group_async(fn, style, **inputs)`` within ``timeout_s``, or why not (a
    ``TimeoutError`` the reward raises itself is an error, not a timeout)."""
    scope = asyncio.timeout(timeout_s)
    try:
        async with scope:
            return await score_group_async(fn, style, **inputs)
    except TimeoutError as err:
        if scope.expired():
            return CallFailed(f"ran past {timeout_s} s", timed_out=True)
        return CallFailed(describe(err))
    except Exception as err:
        return CallFailed(describe(err))


# A process worker's rewards, loaded once by child_init when pebble starts it.
_child_fns: list[Callable[..., Any]] = []
_child_error = ""


def child_init(entries: Sequence[RewardSpec | bytes], files: Sequence[str]) -> None:
    """Loads the sync rewards in a process worker, after the reward files the parent had
    loaded (so that pickled functions of theirs resolve by reference). Never raises (a
    failed initializer would break the pool): each call then reports the error."""
    global _child_error
    try:
        for file in files:
            import_user_file(Path(file))
        _child_fns[:] = [import_reward(e) if isinstance(e, RewardSpec) else pickle.loads(e)
                         for e in entries]
    except BaseException as err:
        _child_error = f"the reward process could not load the rewards: {describe(err)}"


def child_score(slot: int, style: Style, inputs: Mapping[str, Any]
                ) -> RewardValues | CallFailed:
    """One call, in a process worker, of its ``slot``-th sync reward."""
    if _child_error:
        return CallFailed(_child_error)
    return guarded(_child_fns[slot], style, inputs)
