"""Benchmark: the calculator task through the gateway against the same task in-process.

Two questions (docs/agents.md). First, what the OpenAI-compatible path costs: the
calculator task played by examples/agent_openai.py through the rollout engine's gateway
(examples/agent_openai.toml) against the same task through the in-process environment
protocol (examples/cpu_tools.toml, with prefix caching on as the agent's config has
it), at equal samples (steps, groups per step, group size), evaluation off: groups/s of
each and their ratio. Second, whether asynchrony still hides a slow tool through the
gateway: the agent's tool calls take ``--latency-ms`` at the median (rows carrying
``tool_latency_ms``), log-normal with ``--latency-sigma`` as the in-process tool's
``task.tool_latency_ms`` is (``--latency-sigma 0``: every call the median), at
``max_staleness`` 2 against 0. Each run starts and stops its
own Ray. Each pair runs in the order A B B A (gateway, in-process, in-process, gateway;
eta2, eta0, eta0, eta2), and each ratio is of the two runs' means, so a drift of the
shared machine's load over the four runs falls on both arms alike (``--once``: A B
only). The last line is ``gateway: gateway/in-process R1, eta2/eta0 at L ms R2``.

    python -m bench.gateway --model runs/calculator-model
    python -m bench.gateway --model runs/calculator-model --steps 12 --once
    python -m bench.gateway --model runs/calculator-model --set rollout.worker_cores=trainer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from async_rl.api import train
from async_rl.config_io import load_config, toml_value
from async_rl.tasks.calculator import TOOL_LATENCY_SIGMA
from bench.common.overrides import bench_run

ROOT = Path(__file__).resolve().parents[1]
IN_PROCESS = ROOT / "examples" / "cpu_tools.toml"
GATEWAY = ROOT / "examples" / "agent_openai.toml"
ROWS = ROOT / "examples" / "data" / "calculator_train.jsonl"


def groups_per_s(config_path: Path, out: Path, overrides: dict[str, Any],
                 sets: list[str]) -> float:
    """One run of ``config_path`` with ``overrides``, then ``sets`` (``--set`` items),
    into ``out``: its groups/s."""
    items = {**overrides, "run.output_dir": str(out)}.items()
    config = load_config(config_path, [*(f"{k}={toml_value(v)}" for k, v in items), *sets])
    summary = train(config, overwrite=True)
    if summary.stopped:
        raise SystemExit(f"{out}: the run stopped: {summary.stopped}")
    print(f"{out.name}: {summary.groups_per_s:.2f} groups/s, {summary.steps} steps in "
          f"{summary.wall_s:.1f} s, failures "
          f"{ {k: v for k, v in summary.failures.items() if v} }", flush=True)
    return float(summary.groups_per_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/calculator-model")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--groups", type=int, default=8, help="groups per step")
    parser.add_argument("--latency-ms", type=float, default=200.0,
                        help="the tool calls' median latency")
    parser.add_argument("--latency-sigma", type=float, default=TOOL_LATENCY_SIGMA,
                        help="sigma of log(latency); 0: every call takes the median")
    parser.add_argument("--only", choices=("overhead", "latency"),
                        help="one of the two comparisons (default: both)")
    parser.add_argument("--out", default="runs/bench-gateway")
    parser.add_argument("--once", action="store_true", help="each arm once (A B), not A B B A")
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="config override of every arm")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = bench_run(args.model, args.steps, **{"trainer.groups_per_step": args.groups})
    slow = out / "rows-slow-tool.jsonl"
    latency = {"tool_latency_ms": args.latency_ms, "tool_latency_sigma": args.latency_sigma}
    slow.write_text("".join(json.dumps({**json.loads(line), **latency}) + "\n"
                            for line in ROWS.read_text().splitlines() if line))
    arms: dict[str, tuple[Path, dict[str, Any]]] = {
        "gateway": (GATEWAY, common),
        "in-process": (IN_PROCESS, {**common, "rollout.prefix_caching": True}),
        "eta2": (GATEWAY, {**common, "task.path": str(slow), "staleness.max_staleness": 2}),
        "eta0": (GATEWAY, {**common, "task.path": str(slow), "staleness.max_staleness": 0}),
    }
    order = (0, 1) if args.once else (0, 1, 1, 0)
    runs: dict[str, list[float]] = {name: [] for name in arms}
    pairs = {"overhead": ("gateway", "in-process"), "latency": ("eta2", "eta0")}
    for pair in (pairs[args.only],) if args.only else pairs.values():
        for k, i in enumerate(order):
            name = pair[i]
            config, overrides = arms[name]
            runs[name].append(groups_per_s(config, out / f"{name}-{k}", overrides, args.sets))
    mean = {name: sum(v) / len(v) for name, v in runs.items() if v}
    for name in mean:
        print(f"{name}: {', '.join(f'{v:.2f}' for v in runs[name])} groups/s (mean "
              f"{mean[name]:.2f})")
    print(f"tool latency: median {args.latency_ms:g} ms, sigma {args.latency_sigma:g}")
    print(f"gateway: gateway/in-process {ratio(mean, 'gateway', 'in-process')}, eta2/eta0 "
          f"at {args.latency_ms:g} ms {ratio(mean, 'eta2', 'eta0')}")


def ratio(mean: dict[str, float], a: str, b: str) -> str:
    """``a``'s mean over ``b``'s, or "-" for a comparison not run (``--only``)."""
    return f"{mean[a] / mean[b]:.2f}" if a in mean and b in mean else "-"


if __name__ == "__main__":
    main()
