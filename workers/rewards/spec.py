"""Reward functions from user code: naming one in a config, loading it, reading its shape.

Owns: ``RewardSpec`` (one ``[[task.rewards]]`` entry), ``import_reward`` (the callable a
spec names, imported through ``workers.common.user_code``),
``load_reward`` (that, checked: it must be able to take a completion), ``reward_style``
(the calling convention, TRL, verl or per-sample, guessed from the parameters unless
forced), ``Parameters`` (what a callable accepts, for binding its arguments) and the
metric names of several rewards (``unique_names``). A bad spec is a ``ConfigError`` of
one line naming the key. Knows nothing about how rewards are called or where they run
(``workers.rewards.calls``, ``workers.rewards.runner``).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import msgspec

from buffers.common.config import ConfigError
from workers.common.errors import first_line
from workers.common.user_code import absolute_target, import_object

Style = Literal["trl", "verl", "sample"]
"""A reward's calling convention (see ``workers.rewards.calls``)."""
STYLES: tuple[Style, ...] = ("trl", "verl", "sample")
TRL_ARGS = frozenset({"prompts", "completions", "completion_ids"})
"""What a TRL-style reward is called with, besides the dataset columns (as lists)."""
VERL_ARGS = frozenset({"data_source", "solution_str", "ground_truth", "extra_info"})
"""Everything a verl-style reward can be called with."""
SAMPLE_ARGS = frozenset({"prompt", "completion"})
"""What a sample-style reward is called with, besides the dataset columns."""
DEFAULT_COLUMNS: tuple[str, ...] = ("answer",)
"""The dataset columns every built-in prompt source gives (``Prompt.answer``)."""


class RewardSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``[[task.rewards]]`` entry: a reward function in user code and its weight."""

    function: str
    """Where the function is: ``"path/to/file.py:name"`` (relative to the working
    directory) or ``"package.module:name"``; a class there is instantiated once, with no
    arguments, in each process that loads it."""
    weight: float = 1.0
    """Its weight in the sum of the rewards that is a sample's reward."""
    name: str = ""
    """Its metric name (``reward/<name>``); empty = the function's name, made unique."""
    style: Literal["", "trl", "verl", "sample"] = ""
    """How it is called: "trl" (once per group, keyword lists), "verl" (per sample,
    ``solution_str`` and ``ground_truth``) or "sample" (per sample, ``(prompt,
    completion, **columns)``); empty = guessed from its parameters."""


def _fail(index: int, spec: RewardSpec, why: str, field: str = "function") -> ConfigError:
    value = getattr(spec, field)
    return ConfigError(f"config error: task.rewards[{index}].{field} = {value!r}: {why}")


def absolute_spec(spec: RewardSpec, base_dir: str | Path | None = None) -> RewardSpec:
    """``spec`` with its file path made absolute (``absolute_target``)."""
    return msgspec.structs.replace(spec, function=absolute_target(spec.function, base_dir))


def import_reward(spec: RewardSpec, *, index: int = 0,
                  base_dir: str | Path | None = None) -> Callable[..., Any]:
    """The callable ``spec.function`` names, unchecked (a class there instantiated);
    raises ``ConfigError`` naming ``task.rewards[index].function``."""
    obj = import_object(spec.function, f"task.rewards[{index}].function", base_dir=base_dir)
    attr = spec.function.rpartition(":")[2]
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as err:
            raise _fail(index, spec, f"cannot instantiate class {attr} with no "
                                     f"arguments: {first_line(err)}") from None
    if not callable(obj):
        raise _fail(index, spec, f"{attr} is not callable (type {type(obj).__name__})")
    return cast(Callable[..., Any], obj)


def load_reward(spec: RewardSpec, *, index: int = 0, base_dir: str | Path | None = None,
                columns: Collection[str] = DEFAULT_COLUMNS) -> Callable[..., Any]:
    """The callable ``spec.function`` names, checked to take a completion in its style.

    ``index`` is the entry's position in ``task.rewards`` (for the error's key);
    ``columns`` the dataset columns every row has besides the prompt: a required
    parameter that neither the style nor a column provides is a ``ConfigError``.
    """
    fn = import_reward(spec, index=index, base_dir=base_dir)
    if not math.isfinite(spec.weight):
        raise _fail(index, spec, "must be a finite number", field="weight")
    try:
        style = reward_style(fn, spec.style)
    except ValueError:
        raise _fail(index, spec, f"expected one of {_names(STYLES)}", field="style") from None
    why = check_reward(fn, style, columns)
    if why:
        raise _fail(index, spec, why)
    return fn


class Parameters(msgspec.Struct, frozen=True, kw_only=True):
    """What a callable accepts, read from its signature."""

    keywords: frozenset[str]
    """Names it takes by keyword."""
    var_keyword: bool
    """It has ``**kwargs``: takes any keyword."""
    positional: tuple[str, ...]
    """Names of the parameters it takes by position, in order."""
    var_positional: bool
    """It has ``*args``."""
    required: tuple[str, ...]
    """Parameters without a default."""
    positional_only: frozenset[str]
    """Parameters that cannot be given by keyword."""
    known: bool = True
    """False when the signature cannot be read (some builtins): anything goes."""

    @property
    def keyword_mode(self) -> bool:
        """A sample-style reward gets ``prompt`` and ``completion`` by keyword (it names
        one of them, or takes nothing by position); else as its first two arguments."""
        return bool(self.keywords & SAMPLE_ARGS) or not (self.positional or
                                                          self.var_positional)

    def select(self, offered: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments out of ``offered`` that this callable accepts."""
        if self.var_keyword:
            return offered
        return {k: v for k, v in offered.items() if k in self.keywords}


_UNKNOWN = Parameters(keywords=frozenset(), var_keyword=False, positional=("a", "b"),
                      var_positional=True, required=(), positional_only=frozenset(),
                      known=False)


def _read_parameters(fn: Callable[..., Any]) -> Parameters:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return _UNKNOWN
    kinds = inspect.Parameter
    params = list(signature.parameters.values())
    return Parameters(
        keywords=frozenset(p.name for p in params
                           if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)),
        var_keyword=any(p.kind == kinds.VAR_KEYWORD for p in params),
        positional=tuple(p.name for p in params
                         if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)),
        var_positional=any(p.kind == kinds.VAR_POSITIONAL for p in params),
        required=tuple(p.name for p in params if p.default is kinds.empty
                       and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)),
        positional_only=frozenset(p.name for p in params if p.kind == kinds.POSITIONAL_ONLY),
    )


@functools.lru_cache(maxsize=512)
def _cached_parameters(fn: Callable[..., Any]) -> Parameters:
    return _read_parameters(fn)


def parameters(fn: Callable[..., Any]) -> Parameters:
    """``fn``'s parameters (a callable object's ``__call__``'s), cached when hashable."""
    try:
        return _cached_parameters(fn)
    except TypeError:  # unhashable callable object
        return _read_parameters(fn)


def reward_style(fn: Callable[..., Any], forced: str = "") -> Style:
    """``forced`` when set; else "trl" if ``fn`` declares any of prompts, completions,
    completion_ids; "verl" if it declares solution_str and ground_truth; else "sample"."""
    if forced:
        if forced not in STYLES:
            raise ValueError(f"unknown reward style {forced!r} (one of {', '.join(STYLES)})")
        return cast(Style, forced)
    names = parameters(fn).keywords
    if names & TRL_ARGS:
        return "trl"
    if {"solution_str", "ground_truth"} <= names:
        return "verl"
    return "sample"


def _names(names: Collection[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names))


def _missing(params: Parameters, provided: Collection[str], style: str,
             columns: Collection[str]) -> str:
    by_position = sorted(set(params.required) & params.positional_only)
    if by_position:
        return (f"parameter(s) {_names(by_position)} are positional-only, but a {style}-"
                f"style reward is called with keywords")
    missing = [n for n in params.required if n not in provided and n not in columns]
    if not missing:
        return ""
    return (f"required parameter(s) {_names(missing)} are given by no {style}-style "
            f"argument ({_names(provided)}) nor dataset column ({_names(columns)})")


def check_reward(fn: Callable[..., Any], style: Style,
                 columns: Collection[str] = DEFAULT_COLUMNS) -> str:
    """Why ``fn`` cannot be called as a ``style`` reward on rows with ``columns`` ("" if
    it can): it takes no parameters, cannot take the completion, or requires a
    parameter that nothing provides."""
    params = parameters(fn)
    if not params.known:
        return ""
    if not (params.positional or params.keywords or params.var_positional
            or params.var_keyword):
        return "takes no parameters, so it cannot be given a completion"
    if style == "trl":
        if not (params.var_keyword or params.keywords & {"completions", "completion_ids"}):
            return ("takes neither completions nor completion_ids (nor **kwargs), so a "
                    "TRL-style call cannot give it the completions")
        return _missing(params, TRL_ARGS, "TRL", columns)
    if style == "verl":
        if not (params.var_keyword or "solution_str" in params.keywords):
            return "takes no solution_str (nor **kwargs), so a verl-style call cannot give " \
                   "it the completion"
        return _missing(params, VERL_ARGS, "verl", columns)
    if params.keyword_mode:
        if not (params.var_keyword or "completion" in params.keywords):
            return ("takes no completion parameter, so it cannot be given a completion "
                    "(a sample-style reward is called as f(prompt, completion, **columns))")
        return _missing(params, SAMPLE_ARGS, "sample", columns)
    if len(params.positional) < 2 and not params.var_positional:
        return (f"takes {len(params.positional)} positional parameter(s), but a sample-style "
                "reward is called as f(prompt, completion, **columns)")
    rest = Parameters(keywords=params.keywords, var_keyword=params.var_keyword,
                      positional=params.positional[2:], var_positional=False,
                      required=tuple(n for n in params.required
                                     if n not in params.positional[:2]),
                      positional_only=params.positional_only - set(params.positional[:2]))
    return _missing(rest, SAMPLE_ARGS, "sample", columns)


def reward_name(fn: Callable[..., Any]) -> str:
    """A reward's default metric name: its function's name, or its class's for a
    callable object (a partial's function's)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", "") if inspect.isroutine(fn) else type(fn).__name__
    return name if name and name != "<lambda>" else "reward"


def unique_names(derived: Sequence[str], given: Sequence[str]) -> list[str]:
    """One metric name per reward: ``given[i]`` when set, else ``derived[i]`` made unique
    (``correctness``, ``correctness_2``, ...). Raises ValueError (naming both indices)
    when two given names clash."""
    taken: dict[str, int] = {}
    for i, name in enumerate(given):
        if name and name in taken:
            raise ValueError(f"name {name!r} is used by rewards {taken[name]} and {i}")
        if name:
            taken[name] = i
    names: list[str] = []
    for i, (base, name) in enumerate(zip(derived, given, strict=True)):
        if not name:
            name, k = base, 2
            while name in taken:
                name, k = f"{base}_{k}", k + 1
            taken[name] = i
        names.append(name)
    return names
