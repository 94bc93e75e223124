"""Benchmark: what asynchrony buys. The same job at max_staleness 0 (synchronous), 1 and 2.

Runs ``async_rl.shell.ray_shell.run_training`` once per staleness bound η, same config, same
steps, evaluation off, and reads each run's summary and spans. Per run it prints:

- groups/s and tokens/s over the training window (``RunSummary``);
- rollout and trainer idle % over the training window (the controller's spans start
  when its loops do), split by cause (``async_rl.analysis.report.idle_of``): gate_closed means
  rollout waited on the staleness bound, wait_data means the trainer waited on rollout,
  weight_sync / weight_publish are the broadcast;
- speedup: groups/s over the η=0 run's groups/s;
- the pipelining bound, from the η=0 run's measured phase times. η=0 runs the phases
  back to back (generate, train, sync), so one step costs about generate + train + sync,
  while a perfect two-stage pipeline costs max(generate, train) per step:

      bound = (generate + train + sync) / max(generate, train)

  generate = rollout busy seconds ("generate" spans), train = trainer busy seconds
  (forward + backward + optimizer), sync = rollout "weight_sync" seconds; each per
  device (role total / devices of the role), per step. Loading weights pauses the
  engine, so sync stays on rollout's path even when pipelined; the line under the table
  also gives that tighter bound, (generate + train + sync) / max(generate + sync, train).
- speedup / bound: how much of the pipelining win a run realises (1.0 = all of it).
  It can top 1.0 when η > 0 also hides controller overhead or sync, or through noise.

Read it as: η=0's idle split says where synchronous time goes; the bound says what
overlap could win at most; η=1, 2 say what it does win, and their remaining idle causes
say why not more (gate_closed: raise η; wait_data: rollout is the bottleneck).
Timings on a shared 2-core machine are noisy: compare runs made back to back.

    python -m bench.races.sync_vs_async                          # 20 steps at η = 0, 1, 2
    python -m bench.races.sync_vs_async --steps 4 --staleness 0 2 --set rollout.group_size=4
    python -m bench.races.sync_vs_async --json                   # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from async_rl.analysis.idle import Breakdown
from async_rl.analysis.report import RunIdle, idle_of, read_spans
from async_rl.config import Config
from async_rl.config_io import decode_config, load_config
from async_rl.run.inputs import check_inputs
from async_rl.run.summary import RunSummary
from bench.common.quiet_stdout import add_run_options, show, stdout_to_stderr
from buffers.common.config import ConfigError
from workers.common.spans import IDLE

ROLES = ("rollout", "trainer")


class RoleFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One role's time in one run, summed over its devices."""

    devices: int
    wall_s: float
    busy_s: float
    idle_fraction: float
    idle_by_cause: dict[str, float]
    """Fraction of the role's wall time spent idle for each cause."""


class RunFigures(msgspec.Struct, frozen=True, kw_only=True):
    max_staleness: int
    run_dir: str
    steps: int
    wall_s: float
    groups_per_s: float
    tokens_per_s: float
    staleness_histogram: tuple[int, ...]
    dropped_stale: int
    rollout: RoleFigures | None
    trainer: RoleFigures | None
    speedup: float | None
    """groups/s over the η=0 run's groups/s (None without an η=0 run)."""
    speedup_over_bound: float | None


class Bound(msgspec.Struct, frozen=True, kw_only=True):
    """The pipelining bound, from the synchronous run's phase times (per device, per step)."""

    source: str
    generate_s: float
    train_s: float
    sync_s: float
    bound: float | None
    bound_sync_on_rollout: float | None
    """(generate + train + sync) / max(generate + sync, train): sync not hidden."""


class Result(msgspec.Struct, frozen=True, kw_only=True):
    config: str
    steps: int
    overrides: tuple[str, ...]
    bound: Bound | None
    runs: tuple[RunFigures, ...]


def run_config(base: Config, eta: int, steps: int, out_dir: Path) -> Config:
    """The base config at staleness ``eta``: own run dir, no eval, no bar, spans on.

    Goes through the raw dict and ``decode_config`` so cross-field rules (e.g.
    sync_every <= η + 1) are checked again for each η.
    """
    raw = msgspec.to_builtins(base)
    raw["staleness"]["max_staleness"] = eta
    raw["task"]["eval_size"] = 0
    raw["run"].update(num_steps=steps, output_dir=str(out_dir / f"eta{eta}"),
                      progress=False, record_spans=True)
    return decode_config(raw)


def role_figures(idle: RunIdle, role: str) -> RoleFigures | None:
    found = [r for r in idle.roles if r.role == role]
    if not found:
        return None
    item: Breakdown = found[0]
    wall = item.wall_s or 1.0
    return RoleFigures(
        devices=sum(1 for w in idle.workers if w.role == role),
        wall_s=item.wall_s,
        busy_s=item.busy_s,
        idle_fraction=item.idle_fraction,
        idle_by_cause={c: s / wall for c, s in item.idle_by_cause.items()},
    )


def measure(config: Config) -> tuple[RunSummary, RunIdle]:
    """One full run (starts and stops its own Ray), then its idle accounting from spans."""
    from async_rl.shell.ray_shell import run_training

    summary = run_training(config)
    idle, _ = idle_of(read_spans(config.run.output_dir))
    return summary, idle


def phase_bound(summary: RunSummary, idle: RunIdle) -> Bound:
    """Per-device, per-step phase seconds of a synchronous run, and the bound from them."""
    rollout, trainer = role_figures(idle, "rollout"), role_figures(idle, "trainer")
    steps = max(summary.steps, 1)

    def per_step(role: RoleFigures | None, seconds: float) -> float:
        return seconds / max(role.devices if role else 1, 1) / steps

    generate = per_step(rollout, rollout.busy_s if rollout else 0.0)
    train = per_step(trainer, trainer.busy_s if trainer else 0.0)
    sync = per_step(rollout, rollout.idle_by_cause.get("weight_sync", 0.0) * rollout.wall_s
                    if rollout else 0.0)
    total = generate + train + sync
    slowest, slowest_with_sync = max(generate, train), max(generate + sync, train)
    return Bound(
        source=f"max_staleness={summary.max_staleness} run (phases back to back)",
        generate_s=generate, train_s=train, sync_s=sync,
        bound=total / slowest if slowest > 0 else None,
        bound_sync_on_rollout=total / slowest_with_sync if slowest_with_sync > 0 else None,
    )


def analyse(
    measured: Sequence[tuple[Config, RunSummary, RunIdle]],
    config_path: str, steps: int, overrides: Sequence[str],
) -> Result:
    """Speedups against the η=0 run and the bound from its phases (pure: no running)."""
    sync_runs = [(s, i) for c, s, i in measured if c.staleness.max_staleness == 0]
    baseline = sync_runs[0][0].groups_per_s if sync_runs else None
    bound = phase_bound(*sync_runs[0]) if sync_runs else None
    runs = []
    for config, summary, idle in measured:
        speedup = summary.groups_per_s / baseline if baseline else None
        runs.append(RunFigures(
            max_staleness=config.staleness.max_staleness,
            run_dir=config.run.output_dir, steps=summary.steps, wall_s=summary.wall_s,
            groups_per_s=summary.groups_per_s, tokens_per_s=summary.tokens_per_s,
            staleness_histogram=summary.staleness_histogram,
            dropped_stale=summary.dropped_stale,
            rollout=role_figures(idle, "rollout"), trainer=role_figures(idle, "trainer"),
            speedup=speedup,
            speedup_over_bound=speedup / bound.bound
            if speedup is not None and bound is not None and bound.bound else None,
        ))
    return Result(config=config_path, steps=steps, overrides=tuple(overrides), bound=bound,
                  runs=tuple(runs))


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def print_result(result: Result, console: Console) -> None:
    bound = result.bound
    table = Table(title=f"sync vs async: {result.config}, {result.steps} steps per run")
    for column in ("max_staleness", "wall s", "groups/s", "tokens/s", "speedup vs η=0",
                   "bound", "speedup / bound", "rollout idle", "trainer idle",
                   "staleness hist", "dropped stale"):
        table.add_column(column, justify="right")
    for run in result.runs:
        table.add_row(
            str(run.max_staleness), f"{run.wall_s:.1f}", f"{run.groups_per_s:.2f}",
            f"{run.tokens_per_s:.0f}", _x(run.speedup), _x(bound.bound if bound else None),
            _pct(run.speedup_over_bound),
            _pct(run.rollout.idle_fraction if run.rollout else None),
            _pct(run.trainer.idle_fraction if run.trainer else None),
            str(list(run.staleness_histogram)), str(run.dropped_stale),
        )
    console.print(table)

    idle = Table(title="idle by cause (% of the role's wall time, summed over its devices)")
    idle.add_column("max_staleness", justify="right")
    idle.add_column("role")
    idle.add_column("busy", justify="right")
    causes = list(dict.fromkeys(c for role in ROLES for c in IDLE[role]))
    for cause in causes:
        idle.add_column(cause, justify="right")
    for run in result.runs:
        for name, role in (("rollout", run.rollout), ("trainer", run.trainer)):
            if role is None:
                continue
            idle.add_row(
                str(run.max_staleness), name,
                _pct(role.busy_s / role.wall_s if role.wall_s else None),
                *(_pct(role.idle_by_cause[c]) if c in role.idle_by_cause else ""
                  for c in causes),
            )
    console.print(idle)

    if bound is None:
        console.print("no max_staleness=0 run: no speedup or pipelining bound "
                      "(add 0 to --staleness)")
        return
    console.print(
        f"pipelining bound from the {bound.source}, per device per step: generate "
        f"{bound.generate_s:.3f}s + train {bound.train_s:.3f}s + sync {bound.sync_s:.3f}s "
        f"over max(generate, train) = {_x(bound.bound)}; with sync on rollout's path, "
        f"over max(generate + sync, train) = {_x(bound.bound_sync_on_rollout)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    add_run_options(parser, config="examples/cpu_default.toml", steps=20,
                    out_dir="runs/bench-sync-vs-async")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2],
                        help="max_staleness values, one run each, in this order")
    args = parser.parse_args(argv)

    # Workers' logs and the controller's tables go to stdout: with --json they go to
    # stderr during the runs, so that stdout carries the one JSON object only.
    with stdout_to_stderr(args.json):
        try:
            base = check_inputs(load_config(args.config, args.overrides))
            configs = [run_config(base, eta, args.steps, Path(args.out_dir))
                       for eta in args.staleness]
        except ConfigError as err:
            print(str(err), file=sys.stderr)
            return 2
        measured = [(config, *measure(config)) for config in configs]
        result = analyse(measured, args.config, args.steps, args.overrides)
    show(result, args.json, print_result)
    return 0

if __name__ == "__main__":
    sys.exit(main())
