"""Benchmark: how evenly and how fast sequences split over k parts, and micro-batch caps.

For n in {256, 8192, 65536} sequences and k in {8, 64, 512} parts, on lognormal and
bimodal lengths, prints the imbalance (max part cost / mean part cost) and time of:
naive contiguous split, greedy largest-first, raw vectorised Karmarkar-Karp, and the
shipped ``partition`` (KK + refinement, never worse than greedy), next to a lower bound,
plus the worst micro-batch token sum / cap of a full ``plan_step`` over k shards.

    python -m bench.data.balance            # table
    python -m bench.data.balance --json     # one JSON object
Times are the best of ``--repeat`` runs (this is a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from buffers.plan import partition, plan_step, sequence_costs
from buffers.plan.partition import greedy_labels, karmarkar_karp_labels, part_costs

MAX_LEN = 8192


def lognormal(rng: np.random.Generator, n: int) -> np.ndarray:
    """Median 600 tokens, long right tail (RL completions)."""
    return np.clip(rng.lognormal(np.log(600), 0.8, n), 8, MAX_LEN).round().astype(np.int64)


def bimodal(rng: np.random.Generator, n: int) -> np.ndarray:
    """70% short answers around 300 tokens, 30% long reasoning around 6000."""
    short, long = rng.normal(300, 80, n), rng.normal(6000, 1000, n)
    mix = np.where(rng.random(n) < 0.7, short, long)
    return np.clip(mix, 8, MAX_LEN).round().astype(np.int64)


def naive_labels(costs: np.ndarray, k: int) -> np.ndarray:
    """Contiguous split in arrival order, equal counts (what an unbalanced loader does)."""
    return np.minimum(np.arange(len(costs)) * k // max(len(costs), 1), k - 1)


def timed(fn: Callable[[], Any], repeat: int) -> tuple[Any, float]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def imbalance(costs: np.ndarray, labels: np.ndarray, k: int) -> float:
    loads = part_costs(costs, labels, k)
    return float(loads.max() / loads.mean())


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for dist in (lognormal, bimodal):
        for n in args.n:
            lengths = dist(np.random.default_rng(args.seed), n)
            costs = sequence_costs(lengths.tolist(), args.a, args.b)
            for k in args.k:
                row: dict[str, Any] = {"dist": dist.__name__, "n": n, "k": k}
                mean = costs.sum() / k
                row["lower_bound"] = float(max(costs.max(), mean) / mean)
                methods: dict[str, Callable[[], np.ndarray]] = {
                    "naive": lambda c=costs, k=k: naive_labels(c, k),
                    "greedy": lambda c=costs, k=k: greedy_labels(c, k),
                    "kk_raw": lambda c=costs, k=k: karmarkar_karp_labels(c, k),
                }
                for name, fn in methods.items():
                    labels, seconds = timed(fn, args.repeat)
                    row[f"{name}_imbalance"] = imbalance(costs, labels, k)
                    row[f"{name}_ms"] = seconds * 1e3
                parts, seconds = timed(lambda c=costs, k=k: partition(c, k), args.repeat)
                loads = np.array([costs[list(p)].sum() for p in parts])
                row["partition_imbalance"] = float(loads.max() / loads.mean())
                row["partition_ms"] = seconds * 1e3
                plan, seconds = timed(
                    lambda lg=lengths, k=k: plan_step(
                        lg.tolist(), k, args.cap, cost_a=args.a, cost_b=args.b
                    ),
                    1,
                )
                worst = max((t for s in plan.shards for t in s.micro_batch_tokens), default=0)
                row["worst_micro_batch_over_cap"] = worst / args.cap
                row["micro_batches_per_shard"] = plan.num_micro_batches
                row["plan_ms"] = seconds * 1e3
                rows.append(row)
                if not args.json:
                    print(f"  {dist.__name__} n={n} k={k} done", flush=True)
    return rows


def show(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    table = Table(
        title=f"Partition imbalance (max/mean cost, cost = {args.a}*L + {args.b:g}*L^2) "
        f"and time (best of {args.repeat}); micro-batch cap {args.cap}"
    )
    for col in ("dist", "n", "k", "bound"):
        table.add_column(col, justify="right")
    for name in ("naive", "greedy", "KK raw", "partition"):
        table.add_column(f"{name}\nimbalance", justify="right")
        table.add_column("ms", justify="right")
    table.add_column("worst mb\n/ cap", justify="right")
    table.add_column("plan\nms", justify="right")
    for r in rows:
        cells = [r["dist"], str(r["n"]), str(r["k"]), f"{r['lower_bound']:.6f}"]
        for key in ("naive", "greedy", "kk_raw", "partition"):
            cells += [f"{r[key + '_imbalance']:.6f}", f"{r[key + '_ms']:.1f}"]
        cells += [f"{r['worst_micro_batch_over_cap']:.4f}", f"{r['plan_ms']:.0f}"]
        table.add_row(*cells)
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--n", type=int, nargs="+", default=[256, 8192, 65536])
    parser.add_argument("--k", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--a", type=float, default=1.0, help="linear cost per token")
    parser.add_argument("--b", type=float, default=1 / 4096, help="quadratic cost")
    parser.add_argument("--cap", type=int, default=16384, help="micro-batch token cap")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = run(args)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        print(json.dumps({"benchmark": "balance", "config": config, "rows": rows}))
    else:
        show(rows, args)


if __name__ == "__main__":
    main()
