"""Benchmark: ``async-rl tune --simulate-only --allow split`` against an exhaustive sweep.

On a device cluster's config (default: the 1,024-H100 7B example), side by side in this
process:

1. the tune: ``tune(CONFIG, simulate_only=True, allow=["split"], budget_s=B)``, the
   command's own function: the split of the devices between rollout engines and trainer
   shards and the other tunable keys, searched together; its wall time;
2. the exhaustive sweep: every split in steps of ``--step`` devices, each point with the
   tuner's search over the other keys (no budget: until it converges); its best point.

Both winners are then simulated again over the config's whole run.num_steps, and
compared there. Last line: ``split_search: tuned/exhaustive R1, tune wall Xs``.

    python -m bench.simulator.split_search              # 15 split points: long
    python -m bench.simulator.split_search --quick      # splits in steps of 256
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.console import Console

from async_rl import knobs
from async_rl.config import Config
from async_rl.config_io import load_config
from async_rl.tuning.search import Candidate, search
from async_rl.tuning.simulated import simulated
from async_rl.tuning.tune import tune

CONFIG = "examples/sim_h100_7b_1024.toml"


class SplitPoint(msgspec.Struct, frozen=True, kw_only=True):
    split: int
    values: dict[str, knobs.Value]
    groups_per_s: float
    evaluated: int
    seconds: float


def exhaustive(config: Config, step: int) -> list[SplitPoint]:
    """Each split, with the tuner's search over the other keys."""
    points = []
    for split in range(step, knobs.split_total(config), step):
        fixed = knobs.with_values(config, {knobs.SPLIT: split})
        began = time.perf_counter()
        result = search(fixed, knobs.allowed_ranges([], fixed), simulated)
        best: Candidate = result.ranked[0] if result.ranked else result.base
        points.append(SplitPoint(split=split, values={knobs.SPLIT: split, **best.values},
                                 groups_per_s=best.groups_per_s, evaluated=result.evaluated,
                                 seconds=time.perf_counter() - began))
        print(f"  split {split}: {best.groups_per_s:.2f} groups/s ({best.values or 'as is'}; "
              f"{result.evaluated} simulated, {points[-1].seconds:.0f} s)", flush=True)
    return points


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--budget-s", type=float, default=120.0, help="the tune's --budget-s")
    parser.add_argument("--step", type=int, default=64, help="the sweep's split step")
    parser.add_argument("--quick", action="store_true", help="--step 256")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    step = 256 if args.quick else args.step

    out = Path(tempfile.mkdtemp(prefix="split-search-")) / "tuned.toml"
    began = time.perf_counter()
    tuned = tune(args.config, out=str(out), allow=["split"], budget_s=args.budget_s,
                 simulate_only=True, console=Console(width=160))
    tune_wall = time.perf_counter() - began
    chosen = tuned.chosen.values if tuned.chosen else {}
    print(f"tune: {chosen or 'config unchanged'} in {tune_wall:.0f} s", flush=True)

    began = time.perf_counter()
    points = exhaustive(config, step)
    sweep_wall = time.perf_counter() - began
    best = max(points, key=lambda p: p.groups_per_s)

    whole = config.run.num_steps
    tuned_full = simulated(knobs.with_values(config, chosen), whole).groups_per_s
    best_full = simulated(knobs.with_values(config, best.values), whole).groups_per_s
    base_full = simulated(config, whole).groups_per_s
    print(f"exhaustive: {len(points)} splits, {sum(p.evaluated for p in points)} simulated "
          f"in {sweep_wall:.0f} s; best {best.values}")
    print(f"over {whole} steps: config {base_full:.2f}, tuned {tuned_full:.2f}, exhaustive "
          f"best {best_full:.2f} groups/s (after the fill)")
    print(f"split_search: tuned/exhaustive {tuned_full / best_full:.2f}, "
          f"tune wall {tune_wall:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
