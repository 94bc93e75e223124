"""Published sync-to-async speedups, predicted from their setups and the shipped GPU files.

verl's fully async policy README (verl/experimental/fully_async_policy/README.md,
"Asynchronous Training on 7B Model") reports, on H20s with Qwen2.5-Math-7B, DAPO on
dapo-math-17k, max_response_length 28K, rollout.n 16, 512 prompts per step,
ppo_mini_batch_size 32: seconds per step of colocate sync on 32, 64 and 128 GPUs
(790.10, 365.28, 356.30) against fully_async_policy on 16:16, 32:32 and 64:64 (294.77,
189.26, 150.63), i.e. 2.68x, 1.93x and 2.37x (their 400-step totals: 2.66x, 1.92x,
2.35x). Simulated here, with the shipped h20 file:

- colocate sync on N GPUs as max_staleness 0 on N rollout engines and N training devices
  (colocated, the two phases take turns on the same GPUs, so a step costs what it costs
  disaggregated with nothing overlapping: the time is the same, the devices are N);
- fully async on N/2:N/2 as max_staleness 1 (staleness_threshold 0.5, partial rollout:
  in-flight weight updates) with the parameter sync every step of 512 prompts;
- one engine per GPU (7B fits one H20), trainer shards of 8 GPUs (an FSDP2 node), 16
  optimizer updates a step (512 / 32), prompts of 256 tokens;
- what the README leaves out, assumed: response lengths log-normal, median 3,000 tokens,
  sigma 0.9 (DAPO math on this model: means of 2-5K over a run), capped at 28,672, and
  a group's samples sharing half the spread.

Printed: simulated seconds per step of each, the predicted speedup and the published one,
with the error.

    python bench/sim_published.py
    python bench/sim_published.py --steps 4 --median 2000
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec

from async_rl.config import Config
from async_rl.sim.costs import Costs
from async_rl.sim.run import simulate, simulation_costs

PUBLISHED = ((32, 790.10, 294.77), (64, 365.28, 189.26), (128, 356.30, 150.63))
"""(GPUs, colocate sync s/step, fully async s/step) from verl's README table."""
TRAINER_GPUS = 8


def verl_config(rollout: int, trainer: int, max_staleness: int, steps: int, median: float,
                out: Path) -> Config:
    return msgspec.convert({
        "model": {"path": "Qwen/Qwen2.5-Math-7B", "dtype": "bfloat16"},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"num_workers": rollout, "group_size": 16, "max_new_tokens": 28672,
                    "max_inflight_prompts": 512, "stall_timeout_s": 86400.0},
        "queue": {"max_groups": 1024, "max_tokens": 1 << 40, "bucket_edges": [65536]},
        "staleness": {"max_staleness": max_staleness},
        "trainer": {"num_shards": max(trainer // TRAINER_GPUS, 1), "groups_per_step": 512,
                    "micro_batch_tokens": 32768, "mini_batches": 16},
        "run": {"num_steps": steps, "output_dir": str(out), "progress": False,
                "record_spans": False, "eval_every": 0},
        "simulate": {"hardware": "h20", "lengths": "lognormal", "length_median": median,
                     "length_sigma": 0.9, "group_spread": 0.45, "prompt_tokens": 256,
                     "parameters": 7.6e9, "kv_bytes_per_token": 57344},
    }, Config)


def seconds_per_step(rollout: int, trainer: int, max_staleness: int, steps: int,
                     median: float) -> float:
    with tempfile.TemporaryDirectory() as out:
        config = verl_config(rollout, trainer, max_staleness, steps, median, Path(out))
        shipped = simulation_costs(config)
        hardware = msgspec.structs.replace(
            shipped.hardware, devices_per_trainer_shard=min(trainer, TRAINER_GPUS))
        summary = simulate(config, Costs(hardware, shipped.model))
    return summary.wall_s / summary.steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--median", type=float, default=3000.0,
                        help="assumed median response tokens")
    args = parser.parse_args(argv)
    logging.getLogger("async_rl").setLevel(logging.WARNING)
    print("| GPUs | sync s/step sim (published) | async split | async s/step sim (published) "
          "| speedup sim | published | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for gpus, sync_pub, async_pub in PUBLISHED:
        sync = seconds_per_step(gpus, gpus, 0, args.steps, args.median)
        half = gpus // 2
        fast = seconds_per_step(half, half, 1, args.steps, args.median)
        predicted, published = sync / fast, sync_pub / async_pub
        print(f"| {gpus} | {sync:.0f} ({sync_pub:.0f}) | {half}:{half} | {fast:.0f} "
              f"({async_pub:.0f}) | {predicted:.2f}x | {published:.2f}x "
              f"| {predicted / published - 1:+.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
