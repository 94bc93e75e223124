"""Benchmark: does a second rollout engine pay under ``[autopilot]`` on this machine?

The long-tail job (``--config``) from a poor setting (``rollout.max_inflight_prompts =
1``, ``queue.max_groups = 16``) with ``autopilot.enabled = true``, ``--steps`` steps,
two setups in the order A B B A (``--once``: A B; with ``--reverse``, B A): A ``one engine``
(``autopilot.max_rollout_workers = -1``), B ``up to two``
(``autopilot.max_rollout_workers = 2``: the autopilot may add a second engine, on the
trainer's core when the machine has no spare one).

Per run: groups/s over the second half of the steps, as ``autopilot_vs_static``
measures it (the metrics rows' groups over their wait, train and sync seconds: an
engine's start, between steps, is in none of them) and by the wall clock (the ledger's
trained events: from the middle step's end to the last step's, the switch included),
and the autopilot's changes. Last line: ``second_engine: up to two / one engine R1
(second half, rows), R2 (wall)``, of the runs' means.

    python -m bench.tuning.second_engine --lock /tmp/async-rl-heavy.lock \\
        --set run.progress=false
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from statistics import mean

from async_rl.run.run_dir import read_ledger, read_metrics
from bench.tuning.autopilot_vs_static import AUTOPILOT, POOR, describe, measure
from bench.tuning.runs import add_order_options, add_run_options, ordered_runs, train

SETUPS = {"one engine": ("autopilot.max_rollout_workers=-1",),
          "up to two": ("autopilot.max_rollout_workers=2",)}


def wall_second_half(run_dir: Path) -> float:
    """Groups trained after the middle step over the wall time from its end to the last
    step's end (the ledger's trained events: step s trains at version s - 1)."""
    rows = read_metrics(run_dir)
    last = rows[-1]["step"]
    ends: dict[int, float] = {}
    for entry in read_ledger(run_dir):
        if entry.event == "trained":
            ends[entry.version + 1] = max(ends.get(entry.version + 1, 0.0), entry.time)
    groups = sum(r["groups"] for r in rows if r["step"] > last // 2)
    seconds = ends[last] - ends[last // 2]
    return groups / seconds if seconds > 0 else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/cpu_longtail.toml")
    parser.add_argument("--steps", type=int, default=30, help="run.num_steps of every run")
    parser.add_argument("--out", default="runs/second-engine", help="where runs go")
    add_order_options(parser)
    add_run_options(parser)
    args = parser.parse_args(argv)
    rows: dict[str, list[float]] = {name: [] for name in SETUPS}
    walls: dict[str, list[float]] = {name: [] for name in SETUPS}
    for name, run_dir in ordered_runs(list(SETUPS), args.out, args.once, args.reverse):
        train(args.config, run_dir, args.steps,
              [*args.sets, *POOR, *AUTOPILOT, *SETUPS[name]], args.lock)
        measured, wall = measure(name, run_dir), wall_second_half(run_dir)
        rows[name].append(measured.second_half)
        walls[name].append(wall)
        print(f"{name}: second half {measured.second_half:.2f} groups/s (rows), "
              f"{wall:.2f} (wall); whole run {measured.whole:.2f}; "
              f"{len(measured.changes)} change(s): "
              f"{'; '.join(describe(c) for c in measured.changes) or 'none'}", flush=True)
    a, b = SETUPS
    print(f"second_engine: up to two / one engine "
          f"{mean(rows[b]) / mean(rows[a]):.2f} (second half, rows), "
          f"{mean(walls[b]) / mean(walls[a]):.2f} (wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
