"""Benchmark: ``[autopilot]`` against static configs on the long-tail task, at equal steps.

Four setups of ``--config`` (the long-tail job by default), each run ``--steps`` steps
(the config's own 60 by default), each twice in the order A B C D D C B A (the machine's
drift cancels; ``--once``: A B C D):

- A ``poor+autopilot``: ``rollout.max_inflight_prompts = 1``, ``queue.max_groups = 16``
  (the smallest a 16-group step allows), ``autopilot.enabled = true``;
- B ``tuned``: ``--tuned`` (``async-rl tune``'s tuned.toml; ``bench.tuning.tune_vs_grid``
  writes one), static;
- C ``tuned+autopilot``: the same with ``autopilot.enabled = true``;
- D ``grid best``: the config with ``--best`` (the grid's best point), static.

Per run: groups/s over the second half of the steps (the metrics rows' groups over
their wait, train and sync seconds), over the whole run (``summary.json``), the held-out
accuracy at the end, and the autopilot's changes with their outcomes; every revert is
listed. Last line: ``autopilot_vs_static: poor+autopilot/tuned R1 (second half),
tuned+autopilot/grid best R2 (whole run)``, of the runs' means.

    python -m bench.tuning.autopilot_vs_static --lock /tmp/async-rl-heavy.lock \\
        --tuned runs/tune-vs-grid/longtail-tuned.toml \\
        --best rollout.max_inflight_prompts=4 --best queue.max_groups=64
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from statistics import mean

import msgspec

from async_rl.run.run_dir import read_metrics, read_record, read_summary
from async_rl.run.run_record import AutopilotChange
from bench.tuning.runs import add_run_options, train

POOR = ("rollout.max_inflight_prompts=1", "queue.max_groups=16")
AUTOPILOT = ("autopilot.enabled=true",)


class Measured(msgspec.Struct, frozen=True, kw_only=True):
    setup: str
    second_half: float
    """Groups/s over the second half of the steps."""
    whole: float
    accuracy: float | None
    changes: tuple[AutopilotChange, ...]


def second_half(run_dir: Path) -> float:
    """The rows after the middle step: their groups over their wait, train and sync."""
    rows = read_metrics(run_dir)
    if not rows:
        raise SystemExit(f"autopilot_vs_static: {run_dir} logged no step")
    half = [r for r in rows if r["step"] > rows[-1]["step"] // 2]
    seconds = sum(r["wait_s"] + r["train_s"] + r["sync_s"] for r in half)
    return sum(r["groups"] for r in half) / seconds if seconds > 0 else 0.0


def measure(setup: str, run_dir: Path) -> Measured:
    summary, record = read_summary(run_dir), read_record(run_dir)
    return Measured(setup=setup, second_half=second_half(run_dir),
                    whole=summary.groups_per_s, accuracy=summary.accuracy_end,
                    changes=tuple(record.autopilot) if record is not None else ())


def describe(change: AutopilotChange) -> str:
    return f"{change.key} {change.old} -> {change.new} after step {change.step} ({change.outcome})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/cpu_longtail.toml")
    parser.add_argument("--tuned", default="runs/tune-vs-grid/longtail-tuned.toml",
                        help="async-rl tune's tuned.toml of --config")
    parser.add_argument("--best", action="append", default=[], metavar="KEY=VALUE",
                        help="the grid's best point (repeat per key)")
    parser.add_argument("--steps", type=int, default=60, help="run.num_steps of every run")
    parser.add_argument("--out", default="runs/autopilot-vs-static", help="where runs go")
    parser.add_argument("--once", action="store_true", help="each setup once: A B C D")
    parser.add_argument("--only", action="append", default=[], metavar="SETUP",
                        help="run only this setup (repeat; e.g. 'poor+autopilot' and "
                        "'tuned' for the first ratio alone)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    setups = {"poor+autopilot": (args.config, [*POOR, *AUTOPILOT]),
              "tuned": (args.tuned, []),
              "tuned+autopilot": (args.tuned, list(AUTOPILOT)),
              "grid best": (args.config, list(args.best))}
    if unknown := set(args.only) - set(setups):
        parser.error(f"--only: no setup {sorted(unknown)[0]!r} (one of {', '.join(setups)})")
    setups = {name: setup for name, setup in setups.items()
              if not args.only or name in args.only}
    order = list(setups) if args.once else [*setups, *reversed(setups)]
    runs: dict[str, list[Measured]] = {name: [] for name in setups}
    for index, name in enumerate(order):
        config, sets = setups[name]
        run_dir = Path(args.out) / f"{index}-{name.replace('+', '-').replace(' ', '-')}"
        train(config, run_dir, args.steps, [*args.sets, *sets], args.lock)
        measured = measure(name, run_dir)
        runs[name].append(measured)
        print(f"{name}: second half {measured.second_half:.2f} groups/s, whole run "
              f"{measured.whole:.2f}, accuracy {measured.accuracy}; "
              f"{len(measured.changes)} change(s): "
              f"{'; '.join(describe(c) for c in measured.changes) or 'none'}", flush=True)
    reverts = [f"{m.setup}: {describe(c)}: {c.judgement}" for ms in runs.values()
               for m in ms for c in m.changes if c.outcome == "reverted"]
    print(f"reverts: {len(reverts)}" + "".join(f"\n  {line}" for line in reverts))
    half = {name: mean(m.second_half for m in ms) for name, ms in runs.items()}
    whole = {name: mean(m.whole for m in ms) for name, ms in runs.items()}
    for name in setups:
        print(f"{name}: mean second half {half[name]:.2f}, whole run {whole[name]:.2f} groups/s")
    print(f"autopilot_vs_static: poor+autopilot/tuned "
          f"{ratio(half, 'poor+autopilot', 'tuned')} (second half), "
          f"tuned+autopilot/grid best {ratio(whole, 'tuned+autopilot', 'grid best')} "
          "(whole run)")
    return 0


def ratio(means: dict[str, float], top: str, bottom: str) -> str:
    """``top``'s mean over ``bottom``'s; "n/a" when either setup did not run."""
    if top not in means or bottom not in means or means[bottom] <= 0:
        return "n/a"
    return f"{means[top] / means[bottom]:.2f}"


if __name__ == "__main__":
    sys.exit(main())
