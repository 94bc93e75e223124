"""Sweeps: one training run per point of a grid of config values, one run after another.

Owns: parsing ``--grid section.key=v1,v2`` into trials (every combination of the keys'
values, each ``--repeat`` times), naming each trial's run directory, running each trial
as its own ``async-rl train`` process (a fresh Ray each: nothing leaks from one trial
into the next), or with ``simulate`` its own ``async-rl simulate`` process (seconds
each), recording a failed trial's one-line error and going on, and skipping trials that
an earlier sweep finished with the same resolved config. The figures, sweep.csv, the
table and sweep.png come from ``async_rl.analysis.sweep_report``. Knows nothing about
training.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec

from async_rl.analysis.sweep_report import print_table, trial_row, write_csv, write_plot
from async_rl.config import Config
from async_rl.config_io import apply_overrides, load_config, to_toml
from async_rl.run.inputs import check_inputs
from async_rl.run.run_dir import CONFIG, SUMMARY, read_summary
from buffers.common.config import ConfigError

CONSOLE_LOG = "console.log"
"""What a trial's `async-rl train` printed, in its run directory."""
SWEEP_CSV = "sweep.csv"
SWEEP_PNG = "sweep.png"

_UNSAFE = re.compile(r"[^\w.+-]")
"""Characters of a value kept out of a directory name (list brackets, quotes, slashes)."""

Grid = dict[str, tuple[str, ...]]
"""Swept key -> its values as typed on the command line (TOML values), in order."""


class Trial(msgspec.Struct, frozen=True, kw_only=True):
    """One run of a sweep: one value per swept key."""

    name: str
    """Its run directory's name: key=value pairs, and -rN for repeats after the first."""
    values: tuple[tuple[str, str], ...]
    repeat: int


class TrialResult(msgspec.Struct, frozen=True, kw_only=True):
    trial: Trial
    run_dir: Path
    status: Literal["done", "finished_earlier", "failed"]
    error: str = ""
    """The failed trial's one line: its config error, or the last line it printed."""
    seconds: float = 0.0


def split_values(text: str) -> list[str]:
    """Splits at commas outside brackets: ``[64,128],[32,64]`` is two list values."""
    values, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            values.append(text[start:i].strip())
            start = i + 1
    values.append(text[start:].strip())
    return values


def parse_grid(items: Sequence[str]) -> Grid:
    """``section.key=v1,v2`` items -> Grid; a ConfigError names a malformed one.

    Keys are checked here (an unknown key would fail every trial); values are checked
    per trial, so one bad value fails only its own trials.
    """
    grid: Grid = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        values = split_values(text)
        if not sep or not all(values):
            raise ConfigError(f"config error: --grid {item!r}: expected section.key=v1,v2,...")
        if key in grid:
            raise ConfigError(f"config error: --grid {key}: given twice")
        apply_overrides({}, [f"{key}={values[0]}"])  # raises on an unknown section or key
        grid[key] = tuple(values)
    return grid


def trials(grid: Grid, repeat: int) -> list[Trial]:
    """Every combination of the grid's values (first key slowest), ``repeat`` times each."""
    planned = []
    for combination in itertools.product(*grid.values()):
        values = tuple(zip(grid, combination, strict=True))
        base = "__".join(f"{key}={_UNSAFE.sub('_', value)}" for key, value in values)
        planned += [Trial(name=base if r == 0 else f"{base}-r{r}", values=values, repeat=r)
                    for r in range(repeat)]
    return planned


def finished(run_dir: Path, config: Config) -> bool:
    """The run directory holds a finished run of exactly this resolved config (a run
    stopped by a signal or failed writes a summary too, saying so: it runs again)."""
    return ((run_dir / SUMMARY).exists() and (run_dir / CONFIG).exists()
            and (run_dir / CONFIG).read_text() == to_toml(config)
            and not read_summary(run_dir).stopped)


def last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    return next((line for line in reversed(lines) if line), "no output")[:300]


def run_trial(config_path: str, trial: Trial, run_dir: Path, overrides: Sequence[str],
              steps: int | None, simulate: bool = False) -> TrialResult:
    """Runs one trial in its own `async-rl train` (``simulate``: `async-rl simulate`)
    process, unless it finished before."""
    sets = [*overrides, *(f"{key}={value}" for key, value in trial.values),
            # JSON strings are TOML strings: any path survives the override's parsing.
            f"run.output_dir={msgspec.json.encode(str(run_dir)).decode()}"]
    if steps is not None:
        sets.append(f"run.num_steps={steps}")
    try:
        config = load_config(config_path, sets)
        if not simulate:  # a simulated model need not be there
            config = check_inputs(config)  # model.path as the run has it
    except ConfigError as err:
        return TrialResult(trial=trial, run_dir=run_dir, status="failed", error=str(err))
    if finished(run_dir, config):
        return TrialResult(trial=trial, run_dir=run_dir, status="finished_earlier")
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished earlier attempt
    run_dir.mkdir(parents=True)
    command = [sys.executable, "-m", "async_rl.cli", "simulate" if simulate else "train",
               config_path]
    command += [arg for item in sets for arg in ("--set", item)]
    began = time.perf_counter()
    with open(run_dir / CONSOLE_LOG, "wb") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        return TrialResult(trial=trial, run_dir=run_dir, status="failed", seconds=seconds,
                           error=f"exit {done.returncode}: {last_line(run_dir / CONSOLE_LOG)}")
    return TrialResult(trial=trial, run_dir=run_dir, status="done", seconds=seconds)


def describe(result: TrialResult) -> str:
    if result.status == "failed":
        return f"FAILED ({result.error})"
    if result.status == "finished_earlier":
        return "finished earlier, skipped"
    return f"done in {result.seconds:.0f}s (console output: {result.run_dir / CONSOLE_LOG})"


def run_sweep(config_path: str, grid: Grid, *, out: str | Path, steps: int | None = None,
              repeat: int = 1, overrides: Sequence[str] = (),
              simulate: bool = False) -> list[TrialResult]:
    """Runs every trial one after another, then writes sweep.csv and sweep.png and prints
    the table. sweep.csv is rewritten after each trial, so an interrupted sweep keeps
    what it measured."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    planned = trials(grid, repeat)
    results: list[TrialResult] = []
    for number, trial in enumerate(planned, 1):
        label = ", ".join(f"{key} = {value}" for key, value in trial.values)
        label += f" (repeat {trial.repeat})" if trial.repeat else ""
        print(f"[{number}/{len(planned)}] {label}: ", end="", flush=True)
        result = run_trial(config_path, trial, out / trial.name, overrides, steps, simulate)
        print(describe(result), flush=True)
        results.append(result)
        rows = [trial_row(r.run_dir, dict(r.trial.values), repeat=r.trial.repeat,
                          status=r.status, error=r.error) for r in results]
        write_csv(out / SWEEP_CSV, rows)
    print_table(rows, list(grid), title=f"sweep of {config_path}: {out}")
    write_plot(out / SWEEP_PNG, rows, grid)
    print(f"written: {out / SWEEP_CSV}, {out / SWEEP_PNG}")
    return results
