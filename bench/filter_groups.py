"""Benchmark: DAPO's dynamic sampling. The same job with rollout.filter_groups = "none"
and "zero_variance", same steps and seed, side by side in one process.

Runs ``async_rl.shell.ray_shell.run_training`` once per arm and repeat (ABAB order with
``--repeats 2``), each with its own Ray, evaluating the held-out set only at the start
and the end, and reads each run's summary. Per run it prints the final held-out
accuracy (one greedy completion per prompt: accuracy per sample), groups trained per
second over the training window, groups generated per second (filtered ones included)
and the share of generated groups filtered; then zero_variance over none, the means of
each arm's repeats: the accuracy ratio and the groups/s ratio.

Read it as: filtering trains only groups with signal, so a step carries more learning,
but every filtered group costs a generation that trains nothing, so groups/s falls by
about the filtered share when generation is the bottleneck (the long-tail task's is).

    python bench/filter_groups.py                                   # long-tail, 30 steps, AB
    python bench/filter_groups.py --steps 20 --repeats 2            # ABAB
    python bench/filter_groups.py --config examples/cpu_default.toml --json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
from quiet_stdout import add_run_options, show, stdout_to_stderr
from rich.console import Console
from rich.table import Table

from async_rl.config import Config
from async_rl.config_io import decode_config, load_config
from async_rl.run.inputs import check_inputs
from async_rl.run.summary import RunSummary
from buffers.config import ConfigError

ARMS = ("none", "zero_variance")


class RunFigures(msgspec.Struct, frozen=True, kw_only=True):
    filter_groups: str
    repeat: int
    run_dir: str
    steps: int
    wall_s: float
    accuracy_start: float | None
    accuracy_end: float | None
    groups_per_s: float
    generated_per_s: float
    filtered_share: float
    """Filtered groups / groups generated."""


class Result(msgspec.Struct, frozen=True, kw_only=True):
    config: str
    steps: int
    overrides: tuple[str, ...]
    runs: tuple[RunFigures, ...]
    accuracy_ratio: float | None
    """Mean final accuracy of zero_variance over that of none."""
    groups_per_s_ratio: float | None


def run_config(base: Config, arm: str, repeat: int, steps: int, out_dir: Path) -> Config:
    """The base config with ``arm``: its own run dir, evaluations at both ends only."""
    raw = msgspec.to_builtins(base)
    raw["rollout"]["filter_groups"] = arm
    raw["run"].update(num_steps=steps, eval_every=0, progress=False,
                      output_dir=str(out_dir / f"{arm}-r{repeat}"))
    return decode_config(raw)


def figures(config: Config, repeat: int, summary: RunSummary) -> RunFigures:
    wall = summary.wall_s or 1.0
    return RunFigures(
        filter_groups=config.rollout.filter_groups, repeat=repeat,
        run_dir=config.run.output_dir, steps=summary.steps, wall_s=summary.wall_s,
        accuracy_start=summary.accuracy_start, accuracy_end=summary.accuracy_end,
        groups_per_s=summary.groups_per_s,
        generated_per_s=summary.groups_generated / wall,
        filtered_share=(summary.filtered_groups / summary.groups_generated
                        if summary.groups_generated else 0.0),
    )


def ratio(runs: Sequence[RunFigures], field: str) -> float | None:
    """Mean of ``field`` over the zero_variance runs / its mean over the none runs."""
    means = []
    for arm in ARMS:
        values = [getattr(r, field) for r in runs if r.filter_groups == arm]
        if not values or None in values:
            return None
        means.append(statistics.fmean(values))
    return means[1] / means[0] if means[0] else None


def print_result(result: Result, console: Console) -> None:
    table = Table(title=f"rollout.filter_groups: {result.config}, {result.steps} steps per run")
    for column in ("filter_groups", "repeat", "wall s", "accuracy start", "accuracy end",
                   "groups/s trained", "groups/s generated", "filtered"):
        table.add_column(column, justify="right")
    for run in result.runs:
        table.add_row(run.filter_groups, str(run.repeat), f"{run.wall_s:.1f}",
                      f"{run.accuracy_start}", f"{run.accuracy_end}",
                      f"{run.groups_per_s:.2f}", f"{run.generated_per_s:.2f}",
                      f"{100 * run.filtered_share:.1f}%")
    console.print(table)

    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}x"

    console.print(f"zero_variance / none (means of the repeats): final accuracy "
                  f"{x(result.accuracy_ratio)}, groups/s {x(result.groups_per_s_ratio)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    add_run_options(parser, config="examples/cpu_longtail.toml", steps=30,
                    out_dir="runs/bench-filter-groups")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each arm, alternating (2: ABAB)")
    args = parser.parse_args(argv)

    from async_rl.shell.ray_shell import run_training

    with stdout_to_stderr(args.json):
        try:
            base = check_inputs(load_config(args.config, args.overrides))
            plan = [(run_config(base, arm, repeat, args.steps, Path(args.out_dir)), repeat)
                    for repeat in range(1, args.repeats + 1) for arm in ARMS]
        except ConfigError as err:
            print(str(err), file=sys.stderr)
            return 2
        runs = tuple(figures(config, repeat, run_training(config)) for config, repeat in plan)
    result = Result(config=args.config, steps=args.steps, overrides=tuple(args.overrides),
                    runs=runs, accuracy_ratio=ratio(runs, "accuracy_end"),
                    groups_per_s_ratio=ratio(runs, "groups_per_s"))
    show(result, args.json, print_result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
