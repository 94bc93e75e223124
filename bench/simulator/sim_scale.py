"""How the simulator's wall time grows with simulated devices and steps.

Simulates a 7B-parameter model on H100s (the shipped h100 hardware file), half the
devices rollout engines of one GPU, half trainer shards, with long-tailed responses
(log-normal, median 1,000 tokens, cut at 8,192) and one group per rollout engine per
step at max_staleness 1, for every devices x steps point, and prints the wall seconds of
each simulation and its CPU time (the orchestrator, the simulated workers and the run directory; the
report is not built) with the simulated run's groups/s beside them.

With ``--whole``: the whole ``async-rl simulate`` command (a process of its own: the
simulation, the run directory, the report's trace, timeline and idle table, the console)
of the 512-engine, 512-shard config of issue 42 (every shard one H100), timed from start
to exit, with the console's lines and the run directory's largest files.

    python -m bench.simulator.sim_scale
    python -m bench.simulator.sim_scale --devices 64,1024 --steps 100
    python -m bench.simulator.sim_scale --whole
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from async_rl.config import Config
from async_rl.run.run_record import package_versions
from async_rl.sim.costs import Costs
from async_rl.sim.run import simulate, simulation_costs

TRAINER_DEVICES = 8
"""Devices per trainer shard (an FSDP group of one node); rollout engines have one."""


def scale_config(devices: int, steps: int, out: Path) -> Config:
    half = devices // 2
    return msgspec.convert({
        "model": {"path": "Qwen/Qwen2.5-7B", "dtype": "bfloat16"},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"num_workers": half, "group_size": 8, "max_new_tokens": 8192,
                    "max_inflight_prompts": 4},
        "queue": {"max_groups": 4 * half, "max_tokens": 1 << 40,
                  "bucket_edges": [16384, 65536]},
        "staleness": {"max_staleness": 1},
        "trainer": {"num_shards": max(half // TRAINER_DEVICES, 1), "groups_per_step": half // 2,
                    "micro_batch_tokens": 16384},
        "weights": {"sync_every": 1},
        "run": {"num_steps": steps, "output_dir": str(out), "progress": False,
                "record_spans": False, "eval_every": 0},
        "simulate": {"hardware": "h100", "lengths": "lognormal", "length_median": 1000.0,
                     "length_sigma": 0.8, "prompt_tokens": 256, "parameters": 7.6e9,
                     "kv_bytes_per_token": 57344},
    }, Config)


def costs(config: Config) -> Costs:
    """The h100 file with trainer shards of TRAINER_DEVICES devices."""
    hardware = msgspec.structs.replace(simulation_costs(config).hardware,
                                       devices_per_trainer_shard=TRAINER_DEVICES)
    return Costs(hardware, simulation_costs(config).model)


WHOLE = """\
[model]
path = "Qwen/Qwen2.5-7B"
dtype = "bfloat16"
[task]
kind = "longtail"
eval_size = 0
[rollout]
num_workers = 512
group_size = 8
max_new_tokens = 8192
max_inflight_prompts = 4
[queue]
max_groups = 2048
max_tokens = 1099511627776
bucket_edges = [16384, 65536]
[staleness]
max_staleness = 1
[trainer]
num_shards = 512
groups_per_step = 512
micro_batch_tokens = 16384
[run]
num_steps = 100
eval_every = 0
progress = false
output_dir = "{out}"
[simulate]
hardware = "h100"
lengths = "lognormal"
length_median = 1000.0
length_sigma = 0.8
prompt_tokens = 256
parameters = 7.6e9
kv_bytes_per_token = 57344
"""
"""Issue 42's config (its run.output_dir and run.progress = false added)."""


def whole_command() -> None:
    """Times ``async-rl simulate`` of ``WHOLE`` end to end and prints what it wrote."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "run"
        config = Path(scratch) / "whole.toml"
        config.write_text(WHOLE.format(out=out))
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "async_rl.cli", "simulate", str(config)],
                              capture_output=True, text=True, check=True)
        wall = time.perf_counter() - began
        sizes = sorted(((f.stat().st_size, f.name) for f in out.iterdir() if f.is_file()),
                       reverse=True)[:5]
    print(done.stdout, end="")
    print(f"whole async-rl simulate: {wall:.1f} s wall, {len(done.stdout.splitlines())} "
          "console lines; largest files: "
          + ", ".join(f"{name} {size / 1e6:.1f} MB" for size, name in sizes))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--devices", type=_ints, default=[64, 256, 1024])
    parser.add_argument("--steps", type=_ints, default=[25, 50, 100])
    parser.add_argument("--whole", action="store_true",
                        help="time the whole async-rl simulate command of issue 42's config")
    args = parser.parse_args(argv)
    if args.whole:
        whole_command()
        return 0
    logging.getLogger("async_rl").setLevel(logging.WARNING)
    package_versions()  # once per process: not a simulation's cost
    print("| devices (rollout + trainer) | steps | wall s | CPU s | CPU ms per device-step "
          "| simulated groups/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for devices in args.devices:
        for steps in args.steps:
            with tempfile.TemporaryDirectory() as out:
                config = scale_config(devices, steps, Path(out))
                began, cpu = time.perf_counter(), time.process_time()
                summary = simulate(config, costs(config))
                wall, cpu = time.perf_counter() - began, time.process_time() - cpu
            print(f"| {devices} ({devices // 2} + {devices // 2}) | {steps} | {wall:.2f} "
                  f"| {cpu:.2f} | {1e3 * cpu / (devices * steps):.3f} "
                  f"| {summary.groups_per_s:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
