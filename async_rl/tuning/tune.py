"""``async-rl tune``: the config's tunable keys searched on the simulator, tuned.toml written.

Owns: the command's steps within its budget: the config and ``--allow`` ranges; without
``--simulate-only``, a short real run of the config and this machine's hardware file
fitted to it (``real_runs``); the search on the simulator (``search``); without
``--simulate-only``, short real runs of the best few candidates, the best measured kept;
tuned.toml (``tuned_file``: each changed key under a ``# tuned:`` line with its cause
and gains); and the console table of candidates, predicted and measured groups/s.
Knows nothing about how a search moves or how a run is measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from async_rl import knobs
from async_rl.config import Config
from async_rl.config_io import load_config
from async_rl.tuning.real_runs import Measurement, calibration_run, check_runs
from async_rl.tuning.search import Candidate, SearchResult, search, searchable
from async_rl.tuning.simulated import simulated
from async_rl.tuning.tuned_file import file_values, tuned_text

CHECKED = 2
"""Candidates checked with a short real run (besides the config's own calibration run)."""
CHECK_STEPS = 8
"""Steps after the fill of each short real run."""
SEARCH_SHARE = 0.25
"""The least share of ``--budget-s`` the simulated search gets."""


class Tuned(msgspec.Struct, frozen=True, kw_only=True):
    """What ``tune`` did."""

    result: SearchResult | None
    """None: nothing to tune."""
    chosen: Candidate | None
    """The candidate written (None: the config unchanged)."""
    measured: dict[int, float] = {}
    """Measured groups/s of the checked candidates by rank (0: the config)."""
    out: Path
    seconds: float


def tune(config_path: str, *, out: str = "tuned.toml", allow: Sequence[str] = (),
         sets: Sequence[str] = (), budget_s: float = 900.0, simulate_only: bool = False,
         folder: Path | None = None, console: Console | None = None,
         clock: Callable[[], float] = time.monotonic) -> Tuned:
    """Tunes ``config_path`` (with ``sets``) within ``budget_s`` and writes ``out``;
    ``folder``: the real runs' directories (default: the config's run.output_dir +
    "-tune"). A ConfigError names a bad ``--allow`` or config key."""
    # The simulated runs' own console lines (their evaluations, their autopilot) would
    # bury the tune's: the orchestrator's loggers say only warnings meanwhile.
    control = logging.getLogger("async_rl.control")
    level = control.level
    control.setLevel(logging.WARNING)
    try:
        return _tune(config_path, out, allow, sets, budget_s, simulate_only, folder,
                     console, clock)
    finally:
        control.setLevel(level)


def _tune(config_path: str, out: str, allow: Sequence[str], sets: Sequence[str],
          budget_s: float, simulate_only: bool, folder: Path | None,
          console: Console | None, clock: Callable[[], float]) -> Tuned:
    began = clock()
    console = console or Console()
    config = load_config(config_path, sets)
    ranges = knobs.allowed_ranges(allow, config)
    if not searchable(config, ranges):
        console.print("nothing to tune: every allowed key's range holds only the config's "
                      f"value; {out} is the config unchanged")
        return _write(config_path, config, config, None, {}, sets, out, began, clock)
    folder = folder or Path(f"{config.run.output_dir}-tune")
    steps = config.staleness.max_staleness + 1 + CHECK_STEPS
    on = config
    measured: dict[int, float] = {}
    if not simulate_only:
        calibration = calibration_run(config_path, sets, folder, steps)
        if calibration.hardware is None:
            raise RuntimeError(f"the calibration run failed: {calibration.run.error}")
        console.print(calibration.description)
        on = msgspec.structs.replace(config, simulate=msgspec.structs.replace(
            config.simulate, hardware=str(calibration.hardware)))
        if calibration.run.groups_per_s is not None:
            measured[0] = calibration.run.groups_per_s
    # The real checks take about what the calibration run took, each. The search gets
    # at least SEARCH_SHARE of the budget even so: without it a slow calibration run
    # (a busy machine) left no time to search, and the checks may then overrun.
    reserve = 0.0 if simulate_only else CHECKED * (clock() - began)
    result = search(on, ranges, simulated,
                    budget_s=max(SEARCH_SHARE * budget_s,
                                 budget_s - (clock() - began) - reserve))
    chosen = result.ranked[0] if result.ranked else None
    if not simulate_only and result.ranked:
        checks = check_runs(config_path, sets, folder, steps,
                            [knobs.changed(config, knobs.with_values(config, c.values))
                             for c in result.ranked[:CHECKED]])
        measured |= _measured(checks)
        chosen = _best_measured(result, measured)
    _print_table(console, result, measured, simulate_only)
    if result.failures:
        more = len(result.failures) - 1
        console.print(f"failed: {result.failures[0]}" + (f" (and {more} more)" if more else ""))
    if chosen is None:
        console.print(f"no candidate beat the config ({result.evaluated} simulated, "
                      f"{result.failed} refused by the config's rules); {out} is the "
                      "config unchanged")
    tuned = knobs.with_values(config, chosen.values) if chosen else config
    return _write(config_path, config, tuned, result, measured, sets, out, began, clock,
                  chosen)


def _measured(checks: Sequence[Measurement]) -> dict[int, float]:
    return {rank: check.groups_per_s for rank, check in enumerate(checks, 1)
            if check.groups_per_s is not None}


def _best_measured(result: SearchResult, measured: dict[int, float]) -> Candidate | None:
    """The checked candidate measured fastest, if it beat the config's own run."""
    checked = [rank for rank in measured if rank > 0]
    if not checked:
        return None
    rank = max(checked, key=lambda r: measured[r])
    return result.ranked[rank - 1] if measured[rank] > measured.get(0, 0.0) else None


def comments(config: Config, result: SearchResult, chosen: Candidate,
             measured: float | None, measured_base: float | None,
             tuned: Config) -> dict[str, str]:
    """Per key the file sets: ``tuned: CAUSE; OLD -> NEW predicted Gx, measured Mx``."""
    base = result.base.groups_per_s
    gain = f"predicted {chosen.groups_per_s / base:.2f}x" if base else "predicted -"
    gain += (f" ({base:.2f} -> {chosen.groups_per_s:.2f} groups/s over "
             f"{chosen.evaluation.steps} simulated steps)")
    if measured is not None and measured_base:
        gain += f", measured {measured / measured_base:.2f}x"
    lines: dict[str, str] = {}
    for key, why in chosen.reasons.items() | {(k, "") for k in chosen.values
                                              if k not in chosen.reasons}:
        for real in file_values(tuned, {key: chosen.values[key]}):
            before = knobs.value_of(config, real)
            lines[real] = (f"tuned: {why or 'searched'}; {before} -> "
                           f"{knobs.value_of(tuned, real)}: {gain}")
    return lines


def _write(config_path: str, config: Config, tuned: Config, result: SearchResult | None,
           measured: dict[int, float], sets: Sequence[str], out: str, began: float,
           clock: Callable[[], float], chosen: Candidate | None = None) -> Tuned:
    values = set_values(tuned, sets)
    notes = {key: "set on the command line (--set)" for key in values}
    if chosen is not None and result is not None:
        rank = result.ranked.index(chosen) + 1
        values |= file_values(tuned, chosen.values)
        notes |= comments(config, result, chosen, measured.get(rank), measured.get(0), tuned)
    text = Path(config_path).read_text()
    Path(out).write_text(tuned_text(text, values, notes))
    return Tuned(result=result, chosen=chosen, measured=measured, out=Path(out),
                 seconds=clock() - began)


def set_values(config: Config, sets: Sequence[str]) -> dict[str, object]:
    """The ``--set`` keys with their values in ``config`` (so that the file alone gives
    the config the search started from)."""
    raw = msgspec.to_builtins(config)
    values: dict[str, object] = {}
    for item in sets:
        key = item.partition("=")[0].strip()
        value = raw
        for part in key.split("."):
            value = value[part]
        values[key] = value
    return values


def _print_table(console: Console, result: SearchResult, measured: dict[int, float],
                 simulate_only: bool) -> None:
    table = Table(title=f"tune: {result.evaluated} simulated ({result.failed} refused by "
                        f"the config's rules), {result.seconds:.0f} s, stopped: "
                        f"{result.stopped}", title_justify="left")
    for column in ("#", "changes", "predicted groups/s", "x config",
                   *(() if simulate_only else ("measured groups/s",)), "why"):
        table.add_column(column)
    base = result.base.groups_per_s
    for rank, candidate in enumerate((result.base, *result.ranked)):
        changes = ", ".join(f"{k} = {v}" for k, v in candidate.values.items()) or "(config)"
        why = "; ".join(candidate.reasons.values()) or ", ".join(
            f"{role} {cause} {share:.0%}" for role, cause, share
            in candidate.evaluation.causes()[:2])
        row = [str(rank), changes, f"{candidate.groups_per_s:.2f}",
               f"{candidate.groups_per_s / base:.2f}" if base else "-"]
        if not simulate_only:
            row.append(f"{measured[rank]:.2f}" if rank in measured else "-")
        table.add_row(*row, why)
    console.print(table)

