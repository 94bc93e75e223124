"""Benchmark: one rollout worker's generation throughput under two engine set-ups, ABBA.

Starts a ``RolloutWorker`` (no Ray) on one core with a config's model and task, each run
in a fresh process, in ABBA order (twice over with ``--rounds 2``). ``--compare``:

- ``outputs`` (default): ``streamed`` (every engine step's tokens reach the worker,
  vLLM's DELTA outputs: what the worker did before) against ``final`` (one output per
  finished request, FINAL_ONLY: the default);
- ``worker-process``: ``worker-process`` (vLLM's model runner in a process of its own,
  ``rollout.model_in_engine_core = false``: what the worker did before) against ``in-core``
  (the model runs inside the engine core process: the default on a one-core CPU worker).

Each run generates ``--groups`` groups of the task's prompts with
``rollout.max_inflight_prompts`` of them in flight, as a run's admission allows, and
reports groups/s and completion tokens/s. The same prompts in every run, so lengths
match up to sampling. The ratio printed is B over A, medians of tokens/s.

    python -m bench.rollout.rollout_outputs [--compare outputs|worker-process] [--groups 64]
        [--rounds 1] [--config examples/cpu_longtail.toml] [--set key=value ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor

import msgspec

from bench.common.quiet_stdout import stdout_to_stderr
from bench.rollout.rollout_load import checked_overrides, generate_groups

MODES = {"outputs": ("streamed", "final"), "worker-process": ("worker-process", "in-core")}
"""--compare -> (A, the set-up before; B, the default now)."""


class OutputFigures(msgspec.Struct, frozen=True, kw_only=True):
    mode: str
    groups: int
    seconds: float
    groups_per_s: float
    tokens_per_s: float


async def measure(config_path: str, overrides: list[str], mode: str, groups: int,
                  core: int) -> OutputFigures:
    from async_rl.config_io import load_config
    from async_rl.tasks.table import build_task
    from workers.rollout.spec import RolloutSpec
    from workers.rollout.task import WorkerTask
    from workers.rollout.worker import RolloutWorker

    config = load_config(config_path, overrides)
    source, reward_fn, _ = build_task(config)
    rollout = msgspec.structs.replace(
        config.rollout, prefix_caching=True, kv_cache_gib=1,
        stream_tokens=mode == "streamed", model_in_engine_core=mode != "worker-process")
    worker = RolloutWorker(RolloutSpec(rank=0, model=config.model, rollout=rollout,
                                       weights=config.weights, cpu_ids=(core,)),
                           WorkerTask(reward_fn=reward_fn))
    await worker.start()
    try:
        seconds, tokens = await generate_groups(worker, source, groups,
                                                config.rollout.max_inflight_prompts)
    finally:
        await worker.shutdown()
    return OutputFigures(mode=mode, groups=groups, seconds=seconds,
                         groups_per_s=groups / seconds, tokens_per_s=tokens / seconds)


def measure_in_a_process(config_path: str, overrides: list[str], mode: str, groups: int,
                         core: int) -> OutputFigures:
    """``measure`` in a fresh process: vLLM reads some settings once per process."""
    with stdout_to_stderr():  # vLLM logs to stdout
        return asyncio.run(measure(config_path, overrides, mode, groups, core))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=sorted(MODES), default="outputs")
    parser.add_argument("--config", default="examples/cpu_longtail.toml")
    parser.add_argument("--groups", type=int, default=64, help="groups per run")
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--core", type=int, default=0, help="core the worker is pinned to")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()

    before, after = MODES[args.compare]
    order = [before, after, after, before] * args.rounds
    overrides = checked_overrides(args.config, args.overrides)
    runs = []
    for mode in order:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            runs.append(pool.submit(measure_in_a_process, args.config, overrides, mode,
                                    args.groups, args.core).result())
    median = {mode: statistics.median(r.tokens_per_s for r in runs if r.mode == mode)
              for mode in (before, after)}
    ratio = median[after] / median[before]
    if args.json:
        print(msgspec.json.encode({"runs": runs, f"{after}_vs_{before}": ratio}).decode())
        return
    for r in runs:
        print(f"{r.mode:>14}: {r.groups} groups in {r.seconds:.2f} s, "
              f"{r.groups_per_s:.1f} groups/s, {r.tokens_per_s:.0f} tokens/s")
    print(f"{after} / {before} tokens/s (median of {2 * args.rounds} each): {ratio:.2f}x")


if __name__ == "__main__":
    main()
