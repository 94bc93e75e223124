"""Benchmark: CPU an idle rollout worker burns, and how fast it answers after idling.

Starts a ``RolloutWorker`` (no Ray; the tiny model, or ``--model``) on one core, twice:
once with vLLM's idle spin left alone (``rollout.quiet_idle = false``: the engine's
worker process spins for a second after every queue read) and once as the worker runs by
default (it tells the engine to block once nothing is in flight). For each it repeats:
generate a group, stay idle ``--idle`` seconds, generate a group. It reports

- idle_cpu: process-tree CPU seconds (``workers.common.usage.UsageMeter``: the worker and its
  engine processes) per wall second of the idle windows, as a fraction of one core;
- after_idle_ms: median latency of the ``generate_group`` right after an idle window;
- back_to_back_ms: median latency of ``generate_group`` calls with no idle between.

    python -m bench.rollout.idle_cpu [--idle 5] [--repeat 3] [--model DIR] [--json]

vLLM stops spinning by itself after a second idle, so 5 s windows understate a run's
waste: in a run the gaps are shorter than that (try ``--idle 0.3 --repeat 10``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from bench.common.quiet_stdout import stdout_to_stderr

MODES = {"vllm_spin": False, "quiet_when_idle": True}
"""Each mode's rollout.quiet_idle."""


class IdleFigures(msgspec.Struct, frozen=True, kw_only=True):
    mode: str
    idle_s: float
    idle_cpu: float
    after_idle_ms: float
    back_to_back_ms: float


def zero_reward(prompt: object, text: str) -> float:
    return 0.0


async def measure(mode: str, model_dir: Path, idle_s: float,
                  repeat: int, core: int) -> IdleFigures:
    from buffers.common.records import Prompt
    from workers.common.usage import UsageMeter
    from workers.model_config import ModelConfig
    from workers.rollout.config import RolloutConfig
    from workers.rollout.spec import RolloutSpec
    from workers.rollout.task import WorkerTask
    from workers.rollout.worker import RolloutWorker
    from workers.weights.config import WeightsConfig

    # The CPU default's rollout shape: groups of 8, 6 new tokens.
    worker = RolloutWorker(RolloutSpec(
        rank=0, model=ModelConfig(path=str(model_dir)),
        rollout=RolloutConfig(group_size=8, max_new_tokens=6, prefix_caching=True,
                              kv_cache_gib=1, ignore_eos=True, quiet_idle=MODES[mode]),
        weights=WeightsConfig(), cpu_ids=(core,)), WorkerTask(reward_fn=zero_reward))
    await worker.start()
    meter = UsageMeter()
    prompts = [Prompt(prompt_id=f"p{i}", text=f"{i}+{i + 7}=", answer=str(2 * i + 7))
               for i in range(10)]

    async def timed(i: int) -> float:
        began = time.perf_counter()
        await worker.generate_group(prompts[i % len(prompts)])
        return time.perf_counter() - began

    try:
        back_to_back = [await timed(i) for i in range(10)]
        cpu_s = wall_s = 0.0
        after_idle = []
        for i in range(repeat):
            await timed(i)
            first = meter.read()
            await asyncio.sleep(idle_s)
            last = meter.read()
            cpu_s += last.cpu_s - first.cpu_s
            wall_s += last.wall - first.wall
            after_idle.append(await timed(i + 1))
    finally:
        await worker.shutdown()
    return IdleFigures(mode=mode, idle_s=idle_s, idle_cpu=cpu_s / wall_s,
                       after_idle_ms=statistics.median(after_idle) * 1e3,
                       back_to_back_ms=statistics.median(back_to_back) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=float, default=5.0, help="seconds per idle window")
    parser.add_argument("--repeat", type=int, default=3, help="idle windows per mode")
    parser.add_argument("--model", type=Path, help="model dir (default: build the tiny one)")
    parser.add_argument("--core", type=int, default=0, help="core the worker is pinned to")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()

    # vLLM logs to stdout: keep it for the figures either way.
    with stdout_to_stderr(), tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from async_rl.models.tiny_model import make_model

            model_dir = Path(tmp) / "tiny"
            make_model(model_dir, seed=0, sft_steps=20, eval_size=16, log=None)
        figures = [asyncio.run(measure(mode, model_dir, args.idle, args.repeat,
                                       args.core)) for mode in MODES]
    if args.json:
        print(msgspec.json.encode(figures).decode())
        return
    for f in figures:
        print(f"{f.mode:>16}: idle {f.idle_cpu:.1%} of a core over {args.repeat} x "
              f"{f.idle_s:g} s; generate_group after idle {f.after_idle_ms:.0f} ms, "
              f"back to back {f.back_to_back_ms:.0f} ms")


if __name__ == "__main__":
    main()
