"""Span recording overhead: what recording costs a run, measured two ways.

1. Cost model (precise): time ``SpanRecorder.switch`` in a tight loop, count the spans a
   real run recorded (spans.jsonl, every worker) and report
   ``spans x cost per switch / (wall time x workers)``, the fraction of device time spent
   recording.
2. A/B (noisy on a shared 2-core machine): the same config run with
   ``run.record_spans`` on and off in ABBA order, median groups/s of each and the ratio.

Usage: python bench/span_overhead.py [--config examples/cpu_default.toml] [--steps 30]
       [--repeat 1] [--skip-ab] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from async_rl.analysis.report import read_spans
from async_rl.config_io import load_config
from async_rl.run.inputs import check_inputs
from async_rl.shell.ray_shell import run_training
from buffers.config import ConfigError
from workers.spans import SpanRecorder


def switch_cost_s(n: int = 200_000) -> float:
    """Seconds per ``switch`` that changes state (the only kind that records a span)."""
    recorder = SpanRecorder(worker="bench", role="trainer", rank=0, device="cpu:0")
    causes = ("forward", "backward", "optimizer", "idle")
    start = time.perf_counter()
    for i in range(n):
        recorder.switch(causes[i & 3])
        if i % 4096 == 0:
            recorder.drain()
    return (time.perf_counter() - start) / n


def run(config_path: str, steps: int, record: bool, out: Path) -> dict[str, Any]:
    config = check_inputs(load_config(config_path, [
        f"run.num_steps={steps}", f"run.record_spans={'true' if record else 'false'}",
        f'run.output_dir="{out}"', "run.progress=false", "task.eval_size=0",
    ]))
    # The controller prints its worker registry; keep stdout for the JSON object.
    with contextlib.redirect_stdout(sys.stderr):
        summary = run_training(config)
    return {"record_spans": record, "groups_per_s": summary.groups_per_s,
            "wall_s": summary.wall_s, "run_dir": str(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/cpu_default.toml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out-dir", default="runs/bench-span-overhead")
    parser.add_argument("--skip-ab", action="store_true", help="cost model only, no A/B runs")
    parser.add_argument("--repeat", type=int, default=1, help="ABBA rounds (4 runs each)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")

    cost = switch_cost_s()
    result: dict[str, Any] = {"switch_cost_us": cost * 1e6}
    if not args.skip_ab:
        base = Path(args.out_dir)
        # ABBA order, so warm-up and drift hit both arms alike; medians per arm.
        order = [True, False, False, True] * args.repeat
        try:
            runs = [run(args.config, args.steps, record,
                        base / f"run{i}-{'on' if record else 'off'}")
                    for i, record in enumerate(order)]
        except ConfigError as err:  # e.g. no model yet: the line says how to build it
            print(str(err), file=sys.stderr)
            sys.exit(2)
        on = [r for r in runs if r["record_spans"]]
        off = [r for r in runs if not r["record_spans"]]
        spans = read_spans(on[0]["run_dir"])
        workers = len({s.worker for s in spans})
        result.update(
            spans_recorded=len(spans),
            workers=workers,
            modelled_overhead=len(spans) * cost / (on[0]["wall_s"] * max(workers, 1)),
            runs=runs,
            on_groups_per_s=statistics.median(r["groups_per_s"] for r in on),
            off_groups_per_s=statistics.median(r["groups_per_s"] for r in off),
        )
        result["ab_ratio_on_over_off"] = result["on_groups_per_s"] / result["off_groups_per_s"]
    if args.json:
        print(msgspec.json.encode(result).decode())
        return
    table = Table(title="span recording overhead")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("cost per recorded span", f"{result['switch_cost_us']:.2f} us")
    if "runs" in result:
        table.add_row("spans recorded (all workers)", str(result["spans_recorded"]))
        table.add_row("modelled overhead (of device time)", f"{result['modelled_overhead']:.4%}")
        table.add_row("groups/s recording on (median)", f"{result['on_groups_per_s']:.2f}")
        table.add_row("groups/s recording off (median)", f"{result['off_groups_per_s']:.2f}")
        table.add_row("A/B ratio on/off (noisy)", f"{result['ab_ratio_on_over_off']:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
