"""The long-tail task's completion lengths: the reference traces, and a run's samples.

Prints percentiles of completion length in tokens (the byte-level tokenizer gives one
token per character, plus EOS):

- ``reference``: the task's reference completions over ``--prompts`` training prompts
  (what a model that solves every problem would write);
- with ``--run RUN_DIR``: what the policy really generated in that run, from the
  per-step ``completion_tokens`` of its metrics.jsonl (mean, median and max per step,
  so the table gives their spread over the run).

    python -m bench.data.longtail_lengths
    python -m bench.data.longtail_lengths --run runs/cpu-longtail --json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence

from async_rl.run.run_dir import read_metrics
from async_rl.tasks.longtail import (
    MAX_NEW_TOKENS,
    RemainderTask,
    parse_prompt,
    reference_completion,
)


def percentiles(values: Sequence[int]) -> dict[str, float]:
    ordered = sorted(values)

    def at(fraction: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))])

    return {"n": len(ordered), "mean": statistics.fmean(ordered), "p50": at(0.5),
            "p90": at(0.9), "p99": at(0.99), "max": float(ordered[-1]),
            "p99_over_p50": at(0.99) / at(0.5),
            "over_max_new_tokens": sum(v > MAX_NEW_TOKENS for v in ordered) / len(ordered)}


def reference_lengths(prompts: int, seed: int) -> list[int]:
    task = RemainderTask(seed=seed)
    return [len(reference_completion(*parse_prompt(task.prompt_at(i).text))) + 1
            for i in range(prompts)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--prompts", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", help="a run directory of the long-tail task")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    result: dict[str, object] = {"reference": percentiles(reference_lengths(args.prompts,
                                                                            args.seed))}
    if args.run:
        rows = [row["completion_tokens"] for row in read_metrics(args.run)
                if row.get("completion_tokens")]
        if not rows:
            parser.error(f"{args.run}: no completion_tokens in metrics.jsonl")
        result["run_steps"] = {key: percentiles([round(r[key]) for r in rows])
                               for key in ("mean", "p50", "max")}
    if args.json:
        print(json.dumps(result))
        return 0
    ref = result["reference"]
    assert isinstance(ref, dict)
    print(f"reference completions of {ref['n']} prompts (tokens): mean {ref['mean']:.1f}, "
          f"p50 {ref['p50']:.0f}, p90 {ref['p90']:.0f}, p99 {ref['p99']:.0f} "
          f"({ref['p99_over_p50']:.1f}x p50), max {ref['max']:.0f}; "
          f"{ref['over_max_new_tokens']:.2%} longer than {MAX_NEW_TOKENS}")
    if args.run:
        steps = result["run_steps"]
        assert isinstance(steps, dict)
        for key in ("p50", "mean", "max"):
            s = steps[key]
            print(f"run {args.run}, each step's {key} completion length over {s['n']} "
                  f"steps: median {s['p50']:.0f}, p90 {s['p90']:.0f}, max {s['max']:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
