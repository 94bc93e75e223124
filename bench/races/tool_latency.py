"""Benchmark: what a slow tool costs a multi-turn run, and how much of it asynchrony hides.

The calculator tool task (``examples/cpu_tools.toml``) with its tool's median latency
(``task.tool_latency_ms``, log-normal with a heavy tail) at 0, 50 and 200 ms, each at
every ``--staleness`` bound, side by side in one process, evaluation off. A trajectory
waiting on its tool holds no engine time, so a pipelined run can keep generating other
trajectories meanwhile; a synchronous one (``max_staleness`` 0) waits for the slowest
call of every step. Per run it prints groups/s, the ratio against ``max_staleness`` 0 at
the same latency, the rollout and trainer idle split by cause, trajectories per second
and the mean number in flight (Little's law over the prompt ledger: each group's time
from admission to generation, summed, over the run's wall time, times the group size),
and the environment time-outs.

    python -m bench.races.tool_latency                       # 20 steps, staleness 0 and 2
    python -m bench.races.tool_latency --latencies 200 --staleness 0 2 --steps 10
    python -m bench.races.tool_latency --json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from async_rl.config import Config
from async_rl.config_io import decode_config, load_config
from async_rl.run.inputs import check_inputs
from async_rl.run.run_dir import read_ledger
from bench.common.quiet_stdout import add_run_options, show, stdout_to_stderr
from bench.races.sync_vs_async import RoleFigures, measure, role_figures
from buffers.common.config import ConfigError
from buffers.common.reports import LedgerEntry
from workers.common.spans import IDLE

LATENCIES_MS = (0.0, 50.0, 200.0)


class RunFigures(msgspec.Struct, frozen=True, kw_only=True):
    tool_latency_ms: float
    max_staleness: int
    run_dir: str
    groups_per_s: float
    vs_sync: float | None
    """groups/s over the max_staleness 0 run's at the same latency (None without one)."""
    trajectories_per_s: float
    in_flight: float
    """Mean trajectories between admission and generation over the run's wall time."""
    env_timeouts: int
    rollout: RoleFigures | None
    trainer: RoleFigures | None


def run_config(base: Config, latency_ms: float, eta: int, steps: int, out_dir: Path) -> Config:
    raw = msgspec.to_builtins(base)
    raw["staleness"]["max_staleness"] = eta
    raw["task"].update(eval_size=0, tool_latency_ms=latency_ms)
    raw["run"].update(num_steps=steps, progress=False, record_spans=True,
                      output_dir=str(out_dir / f"latency{latency_ms:g}ms-eta{eta}"))
    return decode_config(raw)


def mean_in_flight(ledger: Sequence[LedgerEntry], group_size: int) -> float:
    """Mean trajectories in flight: the summed admitted-to-generated time of every
    generation (a prompt run again counts again), over the span from the first
    admission to the last generation, times the group size."""
    admitted = {(e.prompt_id, e.attempt): e.time for e in ledger if e.event == "admitted"}
    spans = [(admitted[e.prompt_id, e.attempt], e.time) for e in ledger
             if e.event == "generated" and (e.prompt_id, e.attempt) in admitted]
    if not spans:
        return 0.0
    window = max(end for _, end in spans) - min(start for start, _ in spans)
    return group_size * sum(end - start for start, end in spans) / window if window else 0.0


def run_all(base: Config, latencies: Sequence[float], etas: Sequence[int], steps: int,
            out_dir: Path) -> list[RunFigures]:
    figures: list[RunFigures] = []
    group_size = base.rollout.group_size
    for latency in latencies:
        sync: float | None = None
        for eta in etas:
            config = run_config(base, latency, eta, steps, out_dir)
            summary, idle = measure(config)
            if eta == 0:
                sync = summary.groups_per_s
            figures.append(RunFigures(
                tool_latency_ms=latency, max_staleness=eta, run_dir=config.run.output_dir,
                groups_per_s=summary.groups_per_s,
                vs_sync=summary.groups_per_s / sync if sync else None,
                trajectories_per_s=summary.groups_per_s * group_size,
                in_flight=mean_in_flight(read_ledger(config.run.output_dir), group_size),
                env_timeouts=summary.failures.get("env_timeouts", 0),
                rollout=role_figures(idle, "rollout"), trainer=role_figures(idle, "trainer")))
    return figures


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def print_figures(figures: Sequence[RunFigures], console: Console) -> None:
    causes = list(dict.fromkeys(c for role in ("rollout", "trainer") for c in IDLE[role]))
    table = Table(title="tool latency: groups/s against max_staleness 0 at the same latency")
    for column in ("tool ms", "max_staleness", "groups/s", "vs sync", "traj/s", "in flight",
                   "env timeouts", "rollout idle", "trainer idle"):
        table.add_column(column, justify="right")
    for run in figures:
        table.add_row(f"{run.tool_latency_ms:g}", str(run.max_staleness),
                      f"{run.groups_per_s:.2f}",
                      "-" if run.vs_sync is None else f"{run.vs_sync:.2f}x",
                      f"{run.trajectories_per_s:.1f}", f"{run.in_flight:.1f}",
                      str(run.env_timeouts),
                      _pct(run.rollout.idle_fraction if run.rollout else None),
                      _pct(run.trainer.idle_fraction if run.trainer else None))
    console.print(table)
    idle = Table(title="idle by cause (% of the role's wall time)")
    for column in ("tool ms", "max_staleness", "role", *causes):
        idle.add_column(column, justify="right")
    for run in figures:
        for name, role in (("rollout", run.rollout), ("trainer", run.trainer)):
            if role is not None:
                idle.add_row(f"{run.tool_latency_ms:g}", str(run.max_staleness), name,
                             *(_pct(role.idle_by_cause.get(c)) if c in role.idle_by_cause
                               else "" for c in causes))
    console.print(idle)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    add_run_options(parser, config="examples/cpu_tools.toml", steps=20,
                    out_dir="runs/bench-tool-latency")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 2],
                        help="in this order at each latency; 0 is the baseline")
    parser.add_argument("--latencies", type=float, nargs="+", default=list(LATENCIES_MS),
                        metavar="MS", help="median tool latencies (task.tool_latency_ms)")
    args = parser.parse_args(argv)
    with stdout_to_stderr(args.json):
        try:
            base = check_inputs(load_config(args.config, args.overrides))
            if base.task.kind != "calculator":
                raise ConfigError(f"config error: task.kind = {base.task.kind!r}: the "
                                  'benchmark needs task.kind = "calculator" (its tool)')
            for latency in args.latencies:  # every config is checked before the first run
                for eta in args.staleness:
                    run_config(base, latency, eta, args.steps, Path(args.out_dir))
        except ConfigError as err:
            print(str(err), file=sys.stderr)
            return 2
        figures = run_all(base, args.latencies, args.staleness, args.steps,
                          Path(args.out_dir))
    show(figures, args.json, print_figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
