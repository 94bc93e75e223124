"""Benchmark: one CPU rollout worker's generation throughput without and with the
allocator and OpenMP runtime preloaded (``rollout.preload_cpu_libs``), ABAB.

Starts a ``RolloutWorker`` (no Ray) on one core with a config's model and task, each run
in a fresh process (LD_PRELOAD is read when the engine processes start), in ABAB order
(twice over with ``--rounds 2``): ``off`` (``rollout.preload_cpu_libs = false``: vLLM
preloads torch's libgomp only) against ``on`` (tcmalloc and intel-openmp's libiomp5 where
``workers.rollout.engine.preload_cpu_libs`` finds them). Each run generates ``--groups``
groups of the task's prompts with ``rollout.max_inflight_prompts`` of them in flight and
reports groups/s, completion tokens/s, completion tokens per CPU second (of the worker
and its engine processes: less sensitive than tokens/s to other jobs on a shared
machine), the LD_PRELOAD its engine started with and the engine's peak resident memory.
The same prompts in every run, so lengths match up to sampling. The ratios printed are
on over off, medians of tokens/s and of tokens per CPU second.

    python -m bench.rollout.cpu_allocator [--groups 128] [--rounds 1]
        [--config examples/cpu_longtail.toml] [--set key=value ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import msgspec
import psutil

from bench.common.quiet_stdout import stdout_to_stderr
from bench.rollout.rollout_load import checked_overrides, generate_groups

BEFORE, AFTER = "off", "on"


class AllocatorFigures(msgspec.Struct, frozen=True, kw_only=True):
    mode: str
    groups: int
    seconds: float
    groups_per_s: float
    tokens_per_s: float
    tokens_per_cpu_s: float
    """Completion tokens per CPU second of this process and its engine processes."""
    ld_preload: str
    """What the engine processes started with (vLLM's own additions included)."""
    engine_peak_rss_mib: float
    """Peak resident memory (VmHWM) of the largest engine process."""


def cpu_seconds() -> float:
    """CPU time so far of this process and the engine processes it spawned."""
    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def engine_peak_rss_mib() -> float:
    peaks = [0.0]
    for child in psutil.Process().children(recursive=True):
        try:
            status = Path(f"/proc/{child.pid}/status").read_text()
        except OSError:
            continue
        peaks += [int(line.split()[1]) / 1024 for line in status.splitlines()
                  if line.startswith("VmHWM:")]
    return max(peaks)


async def measure(config_path: str, overrides: list[str], mode: str, groups: int,
                  core: int) -> AllocatorFigures:
    from async_rl.config_io import load_config
    from async_rl.tasks.table import build_task
    from workers.rollout.spec import RolloutSpec
    from workers.rollout.task import WorkerTask
    from workers.rollout.worker import RolloutWorker

    config = load_config(config_path, overrides)
    source, reward_fn, _ = build_task(config)
    rollout = msgspec.structs.replace(config.rollout, prefix_caching=True, kv_cache_gib=1,
                                      preload_cpu_libs=mode == AFTER)
    worker = RolloutWorker(RolloutSpec(rank=0, model=config.model, rollout=rollout,
                                       weights=config.weights, cpu_ids=(core,)),
                           WorkerTask(reward_fn=reward_fn))
    await worker.start()
    ld_preload = os.environ.get("LD_PRELOAD", "")
    try:
        cpu_began = cpu_seconds()
        seconds, tokens = await generate_groups(worker, source, groups,
                                                config.rollout.max_inflight_prompts)
        cpu = cpu_seconds() - cpu_began
        peak_mib = engine_peak_rss_mib()
    finally:
        await worker.shutdown()
    return AllocatorFigures(mode=mode, groups=groups, seconds=seconds,
                            groups_per_s=groups / seconds, tokens_per_s=tokens / seconds,
                            tokens_per_cpu_s=tokens / cpu, ld_preload=ld_preload,
                            engine_peak_rss_mib=peak_mib)


def measure_in_a_process(config_path: str, overrides: list[str], mode: str, groups: int,
                         core: int) -> AllocatorFigures:
    """``measure`` in a fresh process: its engine processes start with its LD_PRELOAD."""
    with stdout_to_stderr():  # vLLM logs to stdout
        return asyncio.run(measure(config_path, overrides, mode, groups, core))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/cpu_longtail.toml")
    parser.add_argument("--groups", type=int, default=128, help="groups per run")
    parser.add_argument("--rounds", type=int, default=1, help="ABAB rounds")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--core", type=int, default=0, help="core the worker is pinned to")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()

    order = [BEFORE, AFTER] * (2 * args.rounds)
    overrides = checked_overrides(args.config, args.overrides)
    runs = []
    for mode in order:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            runs.append(pool.submit(measure_in_a_process, args.config, overrides, mode,
                                    args.groups, args.core).result())
    def ratio(field: str) -> float:
        median = {mode: statistics.median(getattr(r, field) for r in runs if r.mode == mode)
                  for mode in (BEFORE, AFTER)}
        return median[AFTER] / median[BEFORE]

    ratios = {f"{AFTER}_vs_{BEFORE}": ratio("tokens_per_s"),
              f"{AFTER}_vs_{BEFORE}_per_cpu_s": ratio("tokens_per_cpu_s")}
    if args.json:
        print(msgspec.json.encode({"runs": runs, **ratios}).decode())
        return
    for r in runs:
        print(f"{r.mode:>3}: {r.groups} groups in {r.seconds:.2f} s, "
              f"{r.groups_per_s:.1f} groups/s, {r.tokens_per_s:.0f} tokens/s, "
              f"{r.tokens_per_cpu_s:.0f} tokens/CPU-s, "
              f"engine peak RSS {r.engine_peak_rss_mib:.0f} MiB, "
              f"LD_PRELOAD={r.ld_preload or '(none)'}")
    wall, cpu = ratios.values()
    print(f"{AFTER} / {BEFORE} (medians of {2 * args.rounds} each): tokens/s {wall:.2f}x, "
          f"tokens per CPU second {cpu:.2f}x")


if __name__ == "__main__":
    main()
