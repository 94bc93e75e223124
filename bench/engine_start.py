"""Benchmark: how long a CPU rollout engine takes to start, by the KV cache it is given.

Starts ``build_engine`` (one core, as a one-core rollout worker runs it) in a fresh
process per start, ABBA-ordered over two ``rollout.kv_cache_gib`` values, and prints the
seconds of each start (the engine built: vLLM imported in its engine core, the model
loaded, the KV cache written, the warm-up run) with B's mean over A's. vLLM's own sizing
(from memory_fraction) gave the small test model 2.39 GiB on this 24 GiB machine; a size
of 0 here is the shipped default (1 GiB when the model's worst case fits in it).

    python bench/engine_start.py --model runs/small-model             # 1 GiB vs 3 GiB
    python bench/engine_start.py --model runs/small-model --sizes 1 3 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time


def start_once(model: str, kv_gib: int) -> float:
    """Builds one engine in this process; returns the seconds the build took."""
    from workers.model_config import ModelConfig
    from workers.rollout.config import RolloutConfig
    from workers.rollout.engine import build_engine

    async def build() -> float:
        began = time.perf_counter()
        engine = build_engine(ModelConfig(path=model), RolloutConfig(kv_cache_gib=kv_gib),
                              rank=0, seed=0, cpu_ids=(0,), transport="gloo")
        seconds = time.perf_counter() - began
        engine.shutdown()
        return seconds

    return asyncio.run(build())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local model directory")
    parser.add_argument("--sizes", type=int, nargs=2, default=(1, 3), metavar=("A", "B"),
                        help="rollout.kv_cache_gib of arm A and arm B")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child's single start
    args = parser.parse_args()
    if args.one is not None:
        print(f"{start_once(args.model, args.one):.3f}")
        return
    a, b = args.sizes
    seconds: dict[int, list[float]] = {a: [], b: []}
    for size in [a, b, b, a] * args.rounds:
        child = subprocess.run([sys.executable, __file__, "--model", args.model,
                                "--one", str(size)], capture_output=True, text=True, check=True)
        seconds[size].append(float(child.stdout.split()[-1]))
        print(f"kv_cache_gib={size}: engine built in {seconds[size][-1]:.1f} s", flush=True)
    mean = {size: statistics.mean(values) for size, values in seconds.items()}
    print(f"mean: {a} GiB {mean[a]:.1f} s, {b} GiB {mean[b]:.1f} s; "
          f"{b} GiB / {a} GiB = {mean[b] / mean[a]:.2f}x")


if __name__ == "__main__":
    main()
