"""Calling one reward function on one group of completions, in its style.

Owns: the three calling conventions and the checks on what comes back:

- **trl**: once per group, by keyword: ``prompts``, ``completions``, ``completion_ids``
  and every other dataset column as a list (one entry per sample); only the keywords it
  declares unless it has ``**kwargs``. Returns one ``float | None`` per sample.
- **verl**: per sample, by keyword: ``solution_str`` (the completion's text),
  ``ground_truth`` (the row's ``ground_truth``, else ``reward_model["ground_truth"]``,
  else ``answer``), ``data_source`` (the row's, else the default given) and
  ``extra_info`` (the row's other columns, with a verl ``extra_info`` dict column merged
  in), each only if declared. Returns a float, or a dict with ``"score"`` and extra
  numeric metrics.
- **sample**: per sample, ``f(prompt, completion, **columns)``: by keyword when it
  names ``prompt`` or ``completion``, else as its first two arguments; the columns it
  declares (all with ``**kwargs``).

``None`` scores 0 and is no error. ``score_group`` calls a sync function (an awaitable
it returns is run to completion); ``score_group_async`` awaits an ``async def`` one, its
per-sample calls concurrently. A call that raises, or returns the wrong shape
(``RewardShapeError``), fails the whole ``score_group``: the runner calls per-sample
styles one sample at a time so that a failure costs that sample only. Knows nothing
about processes, threads or timeouts (``workers.rewards.runner``).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import msgspec

from workers.rewards.spec import TRL_ARGS, Style, parameters

Message = dict[str, Any]
Completion = str | list[Message]
"""A completion: its text, or (TRL, chat templates on) its list of messages."""

_CALL = tuple[tuple[Any, ...], dict[str, Any]]


class RewardShapeError(ValueError):
    """A reward returned something other than its style's shape."""


class RewardValues(msgspec.Struct, frozen=True, kw_only=True):
    """What one reward said about one group."""

    scores: tuple[float | None, ...]
    """One per sample: its finite score, or None (returned None, or not finite)."""
    nonfinite: tuple[int, ...] = ()
    """The samples whose score was NaN or infinite (scored None here; an error to count)."""
    extra: dict[str, tuple[float, ...]] = {}
    """The extra metrics of verl-style dict results: each key's finite numeric values,
    from the samples that gave one."""


def chat_messages(prompts: Sequence[str | list[Message]], completions: Sequence[Completion]
                  ) -> tuple[list[str | list[Message]], list[Completion]]:
    """``prompts`` and ``completions`` as TRL passes conversational ones: each text a
    one-message list (``user`` for a prompt, ``assistant`` for a completion)."""
    return ([[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts],
            [[{"role": "assistant", "content": c}] if isinstance(c, str) else c
             for c in completions])


def completion_text(completion: Completion) -> str:
    """A completion's text (its messages' contents, joined, for a message list)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if isinstance(m, Mapping))


def _ground_truth(columns: Mapping[str, Any]) -> Any:
    if "ground_truth" in columns:
        return columns["ground_truth"]
    reward_model = columns.get("reward_model")
    if isinstance(reward_model, Mapping) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    return columns.get("answer")


def _extra_info(columns: Mapping[str, Any]) -> dict[str, Any]:
    info = {k: v for k, v in columns.items()
            if k not in ("data_source", "ground_truth", "prompt", "extra_info")}
    nested = columns.get("extra_info")
    if isinstance(nested, Mapping):
        info.update(nested)
    return info


def _plan(fn: Callable[..., Any], style: Style, prompts: Sequence[Any],
          completions: Sequence[Completion], completion_ids: Sequence[Sequence[int]],
          columns: Mapping[str, Any], data_source: str) -> list[_CALL]:
    """The (args, kwargs) of each call ``fn`` gets for this group."""
    n = len(completions)
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(f"a group of {n} completions came with {len(prompts)} prompts "
                         f"and {len(completion_ids)} completion_ids")
    params = parameters(fn)
    if style == "trl":
        offered = {k: [v] * n for k, v in columns.items()
                   if k not in TRL_ARGS and k not in ("prompt", "completion")}
        offered |= {"prompts": list(prompts), "completions": list(completions),
                    "completion_ids": [list(ids) for ids in completion_ids]}
        return [((), params.select(offered))]
    if style == "verl":
        base = {"data_source": columns.get("data_source") or data_source,
                "ground_truth": _ground_truth(columns), "extra_info": _extra_info(columns)}
        return [((), params.select({**base, "solution_str": completion_text(c)}))
                for c in completions]
    others = {k: v for k, v in columns.items() if k not in ("prompt", "completion")}
    if params.keyword_mode:
        return [((), params.select({**others, "prompt": p, "completion": c}))
                for p, c in zip(prompts, completions, strict=True)]
    first_two = params.positional[:2]
    kwargs = params.select({k: v for k, v in others.items() if k not in first_two})
    return [((p, c), kwargs) for p, c in zip(prompts, completions, strict=True)]


def _number(value: Any, what: str) -> float:
    if isinstance(value, str | bytes | Mapping):
        raise RewardShapeError(f"{what} is a {type(value).__name__}, not a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise RewardShapeError(f"{what} is a {type(value).__name__}, not a number") from None


def _trl_values(result: Any, n: int) -> list[Any]:
    if hasattr(result, "tolist") and not isinstance(result, list | tuple):
        result = result.tolist()  # numpy arrays, tensors
    if not isinstance(result, list | tuple):
        raise RewardShapeError(f"a TRL-style reward must return a list of {n} scores, "
                               f"got a {type(result).__name__}")
    if len(result) != n:
        raise RewardShapeError(f"a TRL-style reward must return a list of {n} scores "
                               f"(one per completion), got {len(result)}")
    return list(result)


def _collect(style: Style, results: list[Any], n: int) -> RewardValues:
    """The checked ``RewardValues`` of a group's call results (one for TRL, else n)."""
    raw = _trl_values(results[0], n) if style == "trl" else results
    scores: list[float | None] = []
    nonfinite: list[int] = []
    extra: dict[str, list[float]] = {}
    for i, value in enumerate(raw):
        if isinstance(value, Mapping) and style != "trl":
            if "score" not in value:
                raise RewardShapeError("a reward's dict result needs a 'score' key, got "
                                       f"keys {sorted(map(str, value))}")
            for key, metric in value.items():
                if key != "score" and isinstance(metric, numbers.Real) and math.isfinite(metric):
                    extra.setdefault(str(key), []).append(float(metric))
            value = value["score"]
        score = None if value is None else _number(value, f"the score of sample {i}")
        if score is not None and not math.isfinite(score):
            nonfinite.append(i)
            score = None
        scores.append(score)
    return RewardValues(scores=tuple(scores), nonfinite=tuple(nonfinite),
                        extra={k: tuple(v) for k, v in extra.items()})


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def score_group(fn: Callable[..., Any], style: Style, *, prompts: Sequence[Any],
                completions: Sequence[Completion], completion_ids: Sequence[Sequence[int]],
                columns: Mapping[str, Any], data_source: str = "") -> RewardValues:
    """Scores one group with a sync reward ``fn`` in ``style``. ``columns``: the row's
    dataset columns besides the prompt; ``data_source``: the verl name when the row has
    none. Raises what ``fn`` raises, or ``RewardShapeError``."""
    calls = _plan(fn, style, prompts, completions, completion_ids, columns, data_source)
    results = []
    for args, kwargs in calls:
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):  # an async __call__ the guess missed
            result = asyncio.run(_await(result))
        results.append(result)
    return _collect(style, results, len(completions))


async def score_group_async(fn: Callable[..., Any], style: Style, *, prompts: Sequence[Any],
                            completions: Sequence[Completion],
                            completion_ids: Sequence[Sequence[int]],
                            columns: Mapping[str, Any], data_source: str = "") -> RewardValues:
    """``score_group`` for an ``async def`` reward: per-sample calls run concurrently
    (the first to fail cancels the others and is raised)."""
    calls = _plan(fn, style, prompts, completions, completion_ids, columns, data_source)

    async def one(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = fn(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(args, kwargs)) for args, kwargs in calls]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return _collect(style, [task.result() for task in tasks], len(completions))


def is_async_reward(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` (or a callable object's ``__call__``) is an ``async def``."""
    call = getattr(fn, "__call__", None)  # noqa: B004 - the method itself, not callable()
    return inspect.iscoroutinefunction(fn) or (
        not inspect.isroutine(fn) and inspect.iscoroutinefunction(call))
