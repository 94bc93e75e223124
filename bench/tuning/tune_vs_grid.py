"""Benchmark: ``async-rl tune`` against a grid ``sweep`` of the same keys, at equal steps.

Per task (the CPU default, the long-tail task), one after another in this process:

1. the grid: ``async-rl sweep`` of every combination of ``--grid`` values (24 points by
   default: prompts in flight x queue size x the rollout engine's cores x the trainer
   shard's cores), each a run of ``--steps`` steps; its best point by groups/s;
2. the tune: ``async-rl tune CONFIG --allow split --budget-s B`` (a calibration run,
   the simulator's search, short checks), then a run of the tuned config of
   ``--steps`` steps, as the grid's points ran;
3. the final: the grid's best point and the tuned config side by side, each run twice
   in the order best, tuned, tuned, best (ABBA: the machine's drift cancels) for
   ``--final-steps`` steps (the config's own 60 by default: after ``--steps`` the
   policy is mid-climb and the held-out accuracy of the grid's points spreads by 0.2,
   so accuracy is compared where the runs have learned).

It prints, per task: the grid's best point, its groups/s and held-out accuracy; the
tuned config's changes, groups/s and accuracy; tuned/best (of the final's means); the
tune's wall time over the grid's (the grid's: the sum of its trials; the tune's: the
tune command plus the tuned run). Last line: ``tune_vs_grid: tuned/best R1, tune/grid
wall R2`` with, of the tasks, the lower R1 and the higher R2.

    python -m bench.tuning.tune_vs_grid                      # both tasks, 24 points each
    python -m bench.tuning.tune_vs_grid --tasks default --final-only \
        --grid-best rollout.max_inflight_prompts=16 --tuned runs/tune-vs-grid/default-tuned.toml
    python -m bench.tuning.tune_vs_grid --tasks default --steps 10 --final-steps 10 \
        --grid rollout.max_inflight_prompts=4,16 --grid queue.max_groups=16,64

``--final-only``: only step 3, of an earlier grid's best point (``--grid-best``) and an
earlier tune's file (``--tuned``), one task.

``--lock FILE``: every run (each grid point, the tune, each final run) holds ``flock
FILE`` while it runs, so other jobs that take the same lock run between them, never
beside them; wall times count only the runs.

The models: ``async-rl make-model --size small --out runs/small-model`` and
``async-rl make-model --task longtail --out runs/longtail-model`` (``make demo`` and
``make demo-longtail`` build them). The runs want the machine to themselves.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from async_rl.analysis.sweep import parse_grid, run_trial, trials
from async_rl.run.run_dir import read_summary
from bench.tuning.runs import add_run_options, machine, train

TASKS = {"default": "examples/cpu_default.toml", "longtail": "examples/cpu_longtail.toml"}
GRID = ("rollout.max_inflight_prompts=4,16,64", "queue.max_groups=16,64",
        "rollout.cpus_per_worker=1,2", "trainer.cpus_per_shard=1,2")
"""24 points: the keys the tuner searches by default that move groups/s on CPU, and the
split of the cores (on this 2-core machine, a role given 2 shares them with the other)."""


class Final(msgspec.Struct, frozen=True, kw_only=True):
    """One config's runs in the final: groups/s and end accuracy of each."""

    groups_per_s: tuple[float, ...]
    accuracy: tuple[float | None, ...]

    @property
    def mean_groups_per_s(self) -> float:
        return sum(self.groups_per_s) / len(self.groups_per_s)

    @property
    def mean_accuracy(self) -> float | None:
        known = [a for a in self.accuracy if a is not None]
        return sum(known) / len(known) if known else None


class TaskResult(msgspec.Struct, frozen=True, kw_only=True):
    task: str
    grid_points: int
    grid_best: str
    grid_best_groups_per_s: float
    grid_wall_s: float
    tuned_changes: str
    tuned_groups_per_s: float
    tune_wall_s: float
    final_steps: int
    best_final: Final
    tuned_final: Final

    @property
    def ratio(self) -> float:
        return self.tuned_final.mean_groups_per_s / self.best_final.mean_groups_per_s

    @property
    def wall_ratio(self) -> float:
        return self.tune_wall_s / self.grid_wall_s


def _changes(tuned: Path) -> str:
    lines = [line.strip() for line in tuned.read_text().splitlines()]
    return "; ".join(line.removeprefix("# ") for line in lines if line.startswith("# tuned:"))


def _final(best: Sequence[str], tuned: str, config: str, steps: int, out: Path,
           sets: Sequence[str], lock: str) -> tuple[Final, Final]:
    """The grid's best (``config`` with ``best`` set) and ``tuned``, in the order best,
    tuned, tuned, best."""
    runs: dict[str, list[tuple[float, float | None]]] = {"best": [], "tuned": []}
    for index, name in enumerate(("best", "tuned", "tuned", "best")):
        run_dir = out / f"final-{index}-{name}"
        if name == "best":
            train(config, run_dir, steps, [*sets, *best], lock)
        else:
            train(tuned, run_dir, steps, sets, lock)
        summary = read_summary(run_dir)
        runs[name].append((summary.groups_per_s, summary.accuracy_end))
    finals = (Final(groups_per_s=tuple(g for g, _ in runs[name]),
                    accuracy=tuple(a for _, a in runs[name])) for name in ("best", "tuned"))
    best_final, tuned_final = finals
    return best_final, tuned_final


def bench_task(task: str, grid_items: Sequence[str], steps: int, final_steps: int,
               budget_s: int, out: Path, sets: Sequence[str], lock: str) -> TaskResult:
    config = TASKS[task]
    results = []
    for trial in trials(parse_grid(grid_items), repeat=1):
        with machine(lock):
            results.append(run_trial(config, trial, out / f"{task}-grid" / trial.name, sets,
                                     steps))
    grid_wall = sum(r.seconds for r in results)
    done = [r for r in results if r.status == "done"]
    if not done:
        raise SystemExit(f"tune_vs_grid: every grid point of {task} failed")
    best = max(done, key=lambda r: read_summary(r.run_dir).groups_per_s)
    best_summary = read_summary(best.run_dir)

    tuned_file = out / f"{task}-tuned.toml"
    command = [sys.executable, "-m", "async_rl.cli", "tune", config, "--allow", "split",
               "--budget-s", str(budget_s), "--out", str(tuned_file)]
    command += [arg for item in sets for arg in ("--set", item)]
    with machine(lock):
        began = time.perf_counter()
        subprocess.run(command, check=True)
        tune_s = time.perf_counter() - began
    tuned_dir = out / f"{task}-tuned-run"
    tune_wall = tune_s + train(str(tuned_file), tuned_dir, steps, sets, lock)
    tuned = read_summary(tuned_dir)
    best_final, tuned_final = _final([f"{k}={v}" for k, v in best.trial.values],
                                     str(tuned_file), config, final_steps,
                                     out / f"{task}-final", sets, lock)
    return TaskResult(
        task=task, grid_points=len(results),
        grid_best=", ".join(f"{k}={v}" for k, v in best.trial.values),
        grid_best_groups_per_s=best_summary.groups_per_s, grid_wall_s=grid_wall,
        tuned_changes=_changes(tuned_file) or "none", tuned_groups_per_s=tuned.groups_per_s,
        tune_wall_s=tune_wall, final_steps=final_steps, best_final=best_final,
        tuned_final=tuned_final)


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _runs(final: Final) -> str:
    """Each run's groups/s and accuracy, then the means."""
    each = ", ".join(f"{g:.2f} ({_accuracy(a)})"
                     for g, a in zip(final.groups_per_s, final.accuracy, strict=True))
    return (f"{each}; mean {final.mean_groups_per_s:.2f} groups/s, accuracy "
            f"{_accuracy(final.mean_accuracy)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="default,longtail",
                        help="comma-separated: default, longtail")
    parser.add_argument("--grid", action="append", metavar="SECTION.KEY=V1,V2",
                        help=f"grid keys (default: {' '.join(GRID)})")
    parser.add_argument("--steps", type=int, default=20, help="run.num_steps of every run")
    parser.add_argument("--final-steps", type=int, default=60,
                        help="run.num_steps of the final's runs (the best and the tuned)")
    parser.add_argument("--budget-s", type=int, default=300, help="the tune's --budget-s")
    parser.add_argument("--out", default="runs/tune-vs-grid", help="where the runs go")
    add_run_options(parser)
    parser.add_argument("--final-only", action="store_true",
                        help="only the final, of --grid-best and --tuned (one task)")
    parser.add_argument("--grid-best", action="append", default=[], metavar="KEY=VALUE",
                        help="--final-only: an earlier grid's best point (repeat per key)")
    parser.add_argument("--tuned", default="", help="--final-only: an earlier tuned.toml")
    args = parser.parse_args(argv)
    if args.final_only:
        if not args.tuned or "," in args.tasks:
            parser.error("--final-only wants --tuned and one task")
        best, tuned = _final(args.grid_best, args.tuned, TASKS[args.tasks],
                             args.final_steps, Path(args.out) / f"{args.tasks}-final",
                             args.sets, args.lock)
        ratio = tuned.mean_groups_per_s / best.mean_groups_per_s
        print(f"{args.tasks}: final, {args.final_steps} steps, best then tuned then tuned "
              f"then best: best {_runs(best)}; tuned {_runs(tuned)}; tuned/best {ratio:.2f}")
        print(f"tune_vs_grid: tuned/best {ratio:.2f} (final only)")
        return 0
    out = Path(args.out)
    results = [bench_task(task, args.grid or GRID, args.steps, args.final_steps,
                          args.budget_s, out, args.sets, args.lock)
               for task in args.tasks.split(",")]
    for r in results:
        print(f"{r.task}: grid of {r.grid_points} in {r.grid_wall_s:.0f}s, best {r.grid_best}: "
              f"{r.grid_best_groups_per_s:.2f} groups/s")
        print(f"{r.task}: tuned ({r.tuned_changes}) in {r.tune_wall_s:.0f}s: "
              f"{r.tuned_groups_per_s:.2f} groups/s; tune/grid wall {r.wall_ratio:.2f}")
        print(f"{r.task}: final, {r.final_steps} steps, best then tuned then tuned then best: "
              f"best {_runs(r.best_final)}; tuned {_runs(r.tuned_final)}; "
              f"tuned/best {r.ratio:.2f}")
    print(f"tune_vs_grid: tuned/best {min(r.ratio for r in results):.2f}, "
          f"tune/grid wall {max(r.wall_ratio for r in results):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
