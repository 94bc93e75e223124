"""Span recording overhead: what recording costs a run, measured two ways.

1. Cost model (precise): time ``SpanRecorder.switch`` in a tight loop, count the spans a
   real run recorded (spans.jsonl, every worker) and report
   ``spans x cost per switch / (wall time x workers)``, the fraction of device time spent
   recording.
2. A/B (noisy on a shared 2-core machine): the same config run with
   ``run.record_spans`` on and off, groups/s of each and their ratio.

Usage: python bench/span_overhead.py [--config examples/cpu_default.toml] [--steps 30]
       [--skip-ab] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from async_rl.config import load_config
from async_rl.controller import run_training
from async_rl.report import read_spans
from async_rl.spans import SpanRecorder


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
    config = load_config(config_path, [
        f"run.num_steps={steps}", f"run.record_spans={'true' if record else 'false'}",
        f'run.output_dir="{out}"', "run.progress=false", "task.eval_size=0",
    ])
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
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")

    cost = switch_cost_s()
    result: dict[str, Any] = {"switch_cost_us": cost * 1e6}
    if not args.skip_ab:
        base = Path(args.out_dir)
        on = run(args.config, args.steps, True, base / "on")
        off = run(args.config, args.steps, False, base / "off")
        spans = read_spans(on["run_dir"])
        workers = len({s.worker for s in spans})
        result.update(
            spans_recorded=len(spans),
            workers=workers,
            modelled_overhead=len(spans) * cost / (on["wall_s"] * max(workers, 1)),
            on=on, off=off,
            ab_ratio_on_over_off=on["groups_per_s"] / off["groups_per_s"],
        )
    if args.json:
        print(msgspec.json.encode(result).decode())
        return
    table = Table(title="span recording overhead")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("cost per recorded span", f"{result['switch_cost_us']:.2f} us")
    if "on" in result:
        table.add_row("spans recorded (all workers)", str(result["spans_recorded"]))
        table.add_row("modelled overhead (of device time)", f"{result['modelled_overhead']:.4%}")
        table.add_row("groups/s recording on", f"{result['on']['groups_per_s']:.2f}")
        table.add_row("groups/s recording off", f"{result['off']['groups_per_s']:.2f}")
        table.add_row("A/B ratio on/off (noisy)", f"{result['ab_ratio_on_over_off']:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
