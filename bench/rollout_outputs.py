"""Benchmark: one rollout worker's generation throughput, tokens streamed vs final outputs.

Starts a ``RolloutWorker`` (no Ray) on one core with a config's model and task, in each
mode in ABBA order: ``streamed`` (every engine step's tokens reach the worker, vLLM's
DELTA outputs: what the worker did before) and ``final`` (one output per finished
request, FINAL_ONLY: the default). Each run generates ``--groups`` groups of the task's
prompts with ``rollout.max_inflight_prompts`` of them in flight, as a run's admission
allows, and reports groups/s and completion tokens/s. The same prompts in every run, so
lengths match up to sampling.

    python bench/rollout_outputs.py [--config examples/cpu_longtail.toml] [--groups 64]
        [--set key=value ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import msgspec
from quiet_stdout import stdout_to_stderr

ORDER = ("streamed", "final", "final", "streamed")


class OutputFigures(msgspec.Struct, frozen=True, kw_only=True):
    mode: str
    groups: int
    seconds: float
    groups_per_s: float
    tokens_per_s: float


async def measure(config_path: str, overrides: list[str], mode: str, groups: int,
                  core: int) -> OutputFigures:
    from async_rl.config_io import load_config
    from async_rl.launch import build_task
    from workers.rollout import RolloutWorker

    config = load_config(config_path, overrides)
    source, reward_fn, _ = build_task(config)
    worker = RolloutWorker(0, config.model, config.rollout, config.weights, reward_fn,
                           cpu_ids=(core,), kv_cache_gib=1,
                           stream_tokens=mode == "streamed")
    await worker.start()
    admission = asyncio.Semaphore(config.rollout.max_inflight_prompts)
    tokens = 0

    async def one(index: int) -> None:
        nonlocal tokens
        async with admission:
            group = await worker.generate_group(source.prompt_at(index))
            tokens += sum(group.completion_lengths)

    try:
        began = time.perf_counter()
        async with asyncio.TaskGroup() as running:
            for index in range(groups):
                running.create_task(one(index))
        seconds = time.perf_counter() - began
    finally:
        await worker.shutdown()
    return OutputFigures(mode=mode, groups=groups, seconds=seconds,
                         groups_per_s=groups / seconds, tokens_per_s=tokens / seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/cpu_longtail.toml")
    parser.add_argument("--groups", type=int, default=64, help="groups per run")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--core", type=int, default=0, help="core the worker is pinned to")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()

    with stdout_to_stderr():  # vLLM logs to stdout
        runs = [asyncio.run(measure(args.config, args.overrides, mode, args.groups,
                                    args.core)) for mode in ORDER]
    median = {mode: statistics.median(r.tokens_per_s for r in runs if r.mode == mode)
              for mode in ORDER}
    if args.json:
        print(msgspec.json.encode({"runs": runs, "final_vs_streamed":
                                   median["final"] / median["streamed"]}).decode())
        return
    for r in runs:
        print(f"{r.mode:>9}: {r.groups} groups in {r.seconds:.2f} s, "
              f"{r.groups_per_s:.1f} groups/s, {r.tokens_per_s:.0f} tokens/s")
    print(f"final / streamed tokens/s (median of 2 each): "
          f"{median['final'] / median['streamed']:.2f}x")


if __name__ == "__main__":
    main()
