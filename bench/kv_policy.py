"""Benchmark: what an in-flight update does with the running requests' KV cache.

The long-tail task (examples/cpu_longtail.toml, completions of 20 to 300 tokens, so many
requests are running when each version arrives) under ``weights.kv_policy`` "keep" (the
cache the old weights computed stays) and "recompute" (the pause drops it: the running
requests rebuild it under the new weights), at equal samples, evaluation off, arms in
ABBA order (keep, recompute, recompute, keep). Per arm: groups/s over the steps after
the first (the first waits on the engines' start), and over the steps' rows the mean
``kl_behaviour`` (the behaviour policy's distance from the trainer's proximal one, what
the importance weights correct), ``is_weight_max`` and the in-flight staleness. The last
line is ``kv_policy: recompute/keep groups/s R, kl_behaviour keep K1 recompute K2``.

    python -m bench.kv_policy --model runs/longtail-model --steps 20
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from async_rl.api import train
from async_rl.config_io import load_config
from async_rl.run.run_dir import read_metrics
from bench.common.overrides import bench_run

ROOT = Path(__file__).resolve().parents[1]
LONGTAIL = ROOT / "examples" / "cpu_longtail.toml"
ORDER = ("keep", "recompute", "recompute", "keep")


def one_run(policy: str, out: Path, overrides: dict[str, Any]) -> dict[str, float]:
    """One long-tail run under ``policy``: its figures (see the module docstring)."""
    config = load_config(LONGTAIL, {**overrides, "weights.kv_policy": policy,
                                    "run.output_dir": str(out)})
    summary = train(config, overwrite=True)
    if summary.stopped:
        raise SystemExit(f"{out}: the run stopped: {summary.stopped}")
    rows = read_metrics(out)
    if len(rows) < 3:
        raise SystemExit(f"{out}: {len(rows)} steps logged; give --steps of at least 3")
    # Steps after the first: their groups over their wait, train and sync.
    later = rows[1:]
    seconds = sum(row["wait_s"] + row["train_s"] + row["sync_s"] for row in later)
    figures = {
        "groups_per_s": sum(row["groups"] for row in later) / seconds,
        "kl_behaviour": statistics.fmean(row["kl_behaviour"] for row in rows),
        "is_weight_max": statistics.fmean(row["is_weight_max"] for row in rows),
        "staleness_in_flight": statistics.fmean(row["staleness_in_flight_mean"]
                                                for row in rows),
    }
    print(f"{out.name}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()),
          flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/longtail-model")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="runs/bench-kv-policy")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = bench_run(args.model, args.steps)
    arms: dict[str, list[dict[str, float]]] = {"keep": [], "recompute": []}
    for i, policy in enumerate(ORDER):
        arms[policy].append(one_run(policy, out / f"{i}-{policy}", common))

    def mean(policy: str, key: str) -> float:
        return statistics.fmean(run[key] for run in arms[policy])

    print("| kv_policy | groups/s | kl_behaviour | is_weight_max | staleness in flight |")
    print("| --- | --- | --- | --- | --- |")
    for policy in arms:
        print(f"| {policy} | {mean(policy, 'groups_per_s'):.2f} | "
              f"{mean(policy, 'kl_behaviour'):.3g} | {mean(policy, 'is_weight_max'):.3f} | "
              f"{mean(policy, 'staleness_in_flight'):.2f} |")
    print(f"kv_policy: recompute/keep groups/s "
          f"{mean('recompute', 'groups_per_s') / mean('keep', 'groups_per_s'):.2f}, "
          f"kl_behaviour keep {mean('keep', 'kl_behaviour'):.3g} "
          f"recompute {mean('recompute', 'kl_behaviour'):.3g}")


if __name__ == "__main__":
    main()
