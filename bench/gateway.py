"""Benchmark: the calculator task through the gateway against the same task in-process.

Two questions (docs/agents.md). First, what the OpenAI-compatible path costs: the
calculator task played by examples/agent_openai.py through the rollout engine's gateway
(examples/agent_openai.toml) against the same task through the in-process environment
protocol (examples/cpu_tools.toml, with prefix caching on as the agent's config has
it), at equal samples (steps, groups per step, group size), evaluation off: groups/s of
each and their ratio. Second, whether asynchrony still hides a slow tool through the
gateway: each tool call of the agent takes ``--latency-ms`` (rows carrying
``tool_latency_ms``), at ``max_staleness`` 2 against 0. Each run starts and stops its
own Ray; single runs, no ABBA: a first look, not a verdict. The last line is
``gateway: gateway/in-process R1, eta2/eta0 at L ms R2``.

    python -m bench.gateway --model runs/calculator-model
    python -m bench.gateway --model runs/calculator-model --steps 10 --latency-ms 200
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from async_rl.api import train
from async_rl.config_io import load_config
from bench.common.overrides import bench_run

ROOT = Path(__file__).resolve().parents[1]
IN_PROCESS = ROOT / "examples" / "cpu_tools.toml"
GATEWAY = ROOT / "examples" / "agent_openai.toml"
ROWS = ROOT / "examples" / "data" / "calculator_train.jsonl"


def groups_per_s(config_path: Path, out: Path, overrides: dict[str, Any]) -> float:
    """One run of ``config_path`` with ``overrides`` into ``out``: its groups/s."""
    config = load_config(config_path, {**overrides, "run.output_dir": str(out)})
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
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--out", default="runs/bench-gateway")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = bench_run(args.model, args.steps, **{"trainer.groups_per_step": args.groups})
    in_process = groups_per_s(IN_PROCESS, out / "in-process",
                              {**common, "rollout.prefix_caching": True})
    gateway = groups_per_s(GATEWAY, out / "gateway", common)
    slow = out / "rows-slow-tool.jsonl"
    slow.write_text("".join(json.dumps({**json.loads(line), "tool_latency_ms": args.latency_ms})
                            + "\n" for line in ROWS.read_text().splitlines() if line))
    eta = {k: groups_per_s(GATEWAY, out / f"gateway-slow-tool-eta{k}",
                           {**common, "task.path": str(slow), "staleness.max_staleness": k})
           for k in (2, 0)}
    print(f"gateway: gateway/in-process {gateway / in_process:.2f}, eta2/eta0 at "
          f"{args.latency_ms:g} ms {eta[2] / eta[0]:.2f}")


if __name__ == "__main__":
    main()
