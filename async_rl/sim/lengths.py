"""Completion and prompt lengths of simulated groups.

Owns: the length laws of ``simulate.lengths`` (``length_law``): the built-in task's
reference completions, a log-normal law (a group's samples share part of the spread, as
a prompt's answers do), an empirical list (given in the config, or a file of integers:
``file:PATH``, e.g. a dataset's reference lengths), or a real run's ledger, replayed
prompt by prompt (a prompt the run never generated draws one of its groups). Every law is seeded
by the prompt's id and attempt, so a simulated run is the same every time, and a retried
prompt draws anew. Knows nothing about engines or time.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from async_rl.config import Config
from async_rl.run.run_dir import LEDGER, read_ledger
from async_rl.tasks.table import reference_length
from buffers.common.config import ConfigError
from buffers.common.records import Prompt


class LengthLaw(Protocol):
    def completions(self, prompt: Prompt, samples: int) -> tuple[int, ...]:
        """Completion tokens of each of a group's samples (before the cap)."""
        ...


_SHARED = random.Random()


def _rng(prompt: Prompt, salt: str) -> random.Random:
    """A generator seeded by the prompt; one instance, reseeded (half the cost of a new
    one), which is safe as every draw is made before the next reseed."""
    _SHARED.seed(zlib.crc32(f"{salt}:{prompt.prompt_id}:{prompt.attempt}".encode()))
    return _SHARED


class TaskReference:
    """The built-in task's reference completion, plus EOS, for every sample."""

    def __init__(self, length: Callable[[Prompt], int]) -> None:
        self.length = length

    def completions(self, prompt: Prompt, samples: int) -> tuple[int, ...]:
        return (self.length(prompt),) * samples


class LogNormal:
    """log(length) ~ N(log(median), sigma): ``spread`` of it between a group's samples."""

    def __init__(self, median: float, sigma: float, spread: float) -> None:
        self.mu = math.log(median)
        self.spread = min(spread, sigma)
        self.shared = math.sqrt(max(sigma**2 - self.spread**2, 0.0))

    def completions(self, prompt: Prompt, samples: int) -> tuple[int, ...]:
        rng = _rng(prompt, "lognormal")
        centre = rng.gauss(self.mu, self.shared)
        return tuple(max(1, round(math.exp(rng.gauss(centre, self.spread))))
                     for _ in range(samples))


class Empirical:
    """Each sample's length drawn from ``values``."""

    def __init__(self, values: Sequence[int]) -> None:
        self.values = tuple(values)

    def completions(self, prompt: Prompt, samples: int) -> tuple[int, ...]:
        rng = _rng(prompt, "empirical")
        return tuple(rng.choice(self.values) for _ in range(samples))


class Replayed:
    """A real run's generated lengths: a prompt's own group (its attempt-th generation,
    else its last) when the run generated it, else one of the run's groups."""

    def __init__(self, run_dir: str | Path) -> None:
        self.by_prompt: dict[str, list[tuple[int, ...]]] = {}
        for entry in read_ledger(run_dir):
            if entry.event == "generated" and entry.lengths:
                self.by_prompt.setdefault(entry.prompt_id, []).append(entry.lengths)
        self.groups = [g for groups in self.by_prompt.values() for g in groups]
        if not self.groups:
            raise ConfigError(f"config error: simulate.lengths = {str(run_dir)!r}: its "
                              f"{LEDGER} records no generated lengths (a run made before "
                              "the ledger kept them)")

    def completions(self, prompt: Prompt, samples: int) -> tuple[int, ...]:
        own = self.by_prompt.get(prompt.prompt_id)
        group = (own[min(prompt.attempt, len(own) - 1)] if own
                 else _rng(prompt, "replayed").choice(self.groups))
        return tuple(group[k % len(group)] for k in range(samples))


FILE = "file:"
"""simulate.lengths = "file:PATH": lengths drawn from the integers in PATH."""


def lengths_file(path: str) -> list[int]:
    """The completion lengths in a text file: integers separated by white space or commas
    (one a line, or a JSON list); ``ConfigError`` naming the key if there are none or one
    is not a positive integer."""
    key = f"config error: simulate.lengths = {FILE + path!r}"
    try:
        words = Path(path).read_text().replace(",", " ").replace("[", " ").replace("]", " ")
    except OSError as err:
        raise ConfigError(f"{key}: {err.strerror or err}") from None
    values = []
    for word in words.split():
        if not word.isdigit() or int(word) < 1:
            raise ConfigError(f"{key}: {word!r} is not a positive integer")
        values.append(int(word))
    if not values:
        raise ConfigError(f"{key}: the file holds no lengths")
    return values


def length_law(config: Config) -> LengthLaw:
    """The law ``simulate.lengths`` names; ``ConfigError`` naming the key if it cannot be."""
    sim, kind = config.simulate, config.simulate.lengths
    if kind == "task":
        reference = reference_length(config.task)
        if reference is None:
            raise ConfigError(f'config error: simulate.lengths = "task": task.kind = '
                              f'"{config.task.kind}" has no reference lengths: use '
                              '"lognormal", "empirical" or a run directory')
        return TaskReference(reference)
    if kind == "lognormal":
        return LogNormal(sim.length_median, sim.length_sigma, sim.group_spread)
    if kind == "empirical":
        if not sim.length_values:
            raise ConfigError('config error: simulate.length_values = []: lengths = '
                              '"empirical" draws from them: give some')
        return Empirical(sim.length_values)
    if kind.startswith(FILE):
        return Empirical(lengths_file(kind.removeprefix(FILE)))
    if not (Path(kind) / LEDGER).is_file():
        raise ConfigError(f"config error: simulate.lengths = {kind!r}: not task, lognormal, "
                          f"empirical, file:PATH or a run directory (no {LEDGER} there)")
    return Replayed(kind)


def prompt_tokens(config: Config, prompt: Prompt) -> int:
    """The prompt's tokens: simulate.prompt_tokens, else its text's bytes (the byte-level
    tokenizer of the built-in models adds no BOS)."""
    return config.simulate.prompt_tokens or len(prompt.text.encode())
