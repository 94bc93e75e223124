"""The simulator against real runs: calibrated on one real run per task, it predicts the
others, and the table says by how much it misses.

For each built-in CPU task (``examples/cpu_default.toml``, ``examples/cpu_longtail.toml``)
the real runs are short (40 steps, no evaluations during training). One is the
calibration run (``async-rl simulate --calibrate``, which writes ``RUN_DIR/hardware.toml``:
max_staleness 2 with one rollout worker on the default task, max_staleness 1 with one on
the long-tail task); the other settings of max_staleness 0, 1 and 2 with one and two
rollout workers are predicted with that file and the calibration run's own generated
lengths (its ledger, when it records them; else the task's reference lengths). A real
run already in ``--out`` with a summary is reused; a missing one is trained first, each
under ``flock --lock`` when given (real runs need the machine to themselves), or left
out with ``--existing``. ``--out`` given twice or more makes repeats of every real run
(trained in alternate orders: A B B A), and each predicted setting is set against the
mean of its repeats, calibrated on the first repeat's calibration run. Printed, per
predicted run: groups/s measured (the mean of its repeats, and how far apart they were)
and predicted with the error, and each role's idle fraction, in total and by cause,
measured vs predicted, with the difference in points; and the median seconds of a
training step, measured and predicted: the same work takes as long in every simulated
run, while on a shared machine it does not in real ones.

    python -m bench.simulator.sim_vs_real --lock /tmp/heavy.lock
    python -m bench.simulator.sim_vs_real --lock /tmp/heavy.lock --out runs/svr-a --out runs/svr-b
    python -m bench.simulator.sim_vs_real --existing --tasks longtail --json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from async_rl.analysis.report import idle_of, read_spans
from async_rl.config_io import load_config
from async_rl.run.run_dir import CONFIG, read_ledger, read_metrics, read_summary
from async_rl.sim.calibrate import calibrate
from async_rl.sim.run import simulate

TASKS = {"default": "examples/cpu_default.toml", "longtail": "examples/cpu_longtail.toml"}
CALIBRATION = {"default": (2, 1), "longtail": (1, 1)}
"""(max_staleness, rollout workers) of the run each task is calibrated on."""
SETTINGS = ((0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2))
REAL = ("run.num_steps=40", "run.eval_every=0", "task.eval_size=50", "run.progress=false")
"""What every real run overrides of its task's example config."""


def _string(text: str) -> str:
    return json.dumps(text)


def real_run(task: str, staleness: int, workers: int, out: Path, lock: str | None
             ) -> Path | None:
    """The real run's directory, trained first when it has no summary (``lock`` None:
    left out instead)."""
    run_dir = out / f"{task}-s{staleness}-w{workers}"
    if (run_dir / "summary.json").exists():
        return run_dir
    if lock is None:
        return None
    sets = [*REAL, f"staleness.max_staleness={staleness}", f"rollout.num_workers={workers}",
            f"run.output_dir={_string(str(run_dir))}"]
    command = [sys.executable, "-m", "async_rl.cli", "train", TASKS[task], "--overwrite",
               *(arg for item in sets for arg in ("--set", item))]
    print(f"training {run_dir} ...", flush=True)
    with open(out / f"{run_dir.name}.log", "wb") as log:
        subprocess.run((["flock", lock] if lock else []) + command, stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    return run_dir


def figures(run_dir: Path) -> dict[str, Any]:
    """groups/s, the median train_s of a step, and each role's idle fraction, in total
    and by cause."""
    idle, _ = idle_of(read_spans(run_dir))
    roles = {r.role: {"idle": r.idle_fraction,
                      **{c: s / r.wall_s for c, s in r.idle_by_cause.items() if r.wall_s}}
             for r in idle.roles}
    train_s = statistics.median(row["train_s"] for row in read_metrics(run_dir))
    return {"groups_per_s": read_summary(run_dir).groups_per_s, "train_s": train_s,
            "roles": roles}


def predict(real_dir: Path, hardware: Path, lengths: str, out: Path) -> Path:
    sim_dir = out / f"sim-{real_dir.name}"
    sets = [f"simulate.hardware={_string(str(hardware))}", f"simulate.lengths={lengths}",
            f"run.output_dir={_string(str(sim_dir))}", "run.progress=false"]
    simulate(load_config(real_dir / CONFIG, sets))
    return sim_dir


def mean_figures(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The mean of repeated runs' ``figures`` (a cause one run lacks counts as 0), with
    ``spread``: the largest groups/s over the smallest, less 1."""
    rates = [r["groups_per_s"] for r in repeats]
    roles = {role: {key: statistics.fmean(r["roles"][role].get(key, 0.0) for r in repeats)
                    for key in dict.fromkeys(k for r in repeats for k in r["roles"][role])}
             for role in repeats[0]["roles"]}
    return {"groups_per_s": statistics.fmean(rates),
            "train_s": statistics.fmean(r["train_s"] for r in repeats), "roles": roles,
            "spread": max(rates) / min(rates) - 1}


def predicted(task: str) -> list[tuple[int, int]]:
    """The settings of ``task`` the simulator predicts: all but its calibration run's."""
    return [setting for setting in SETTINGS if setting != CALIBRATION[task]]


def train_all(tasks: Sequence[str], outs: Sequence[Path], lock: str) -> None:
    """Every real run of every repeat, the repeats in alternate orders (A B B A: a
    machine that drifts over the session does not favour one setting)."""
    runs = [(task, *setting) for task in tasks
            for setting in (CALIBRATION[task], *predicted(task))]
    for i, out in enumerate(outs):
        for task, staleness, workers in reversed(runs) if i % 2 else runs:
            real_run(task, staleness, workers, out, lock)


def compare(task: str, outs: Sequence[Path], lock: str | None) -> list[dict[str, Any]]:
    """Calibrated on the first repeat's calibration run, the other settings predicted and
    set against the mean of their repeats."""
    out = outs[0]
    calibration = real_run(task, *CALIBRATION[task], out, lock)
    if calibration is None:
        return []
    hardware = calibration / "hardware.toml"
    fit = calibrate(calibration, hardware)
    print(f"{task}: calibrated on {calibration}:\n{fit.describe()}", flush=True)
    replay = any(e.lengths for e in read_ledger(calibration) if e.event == "generated")
    lengths = _string(str(calibration)) if replay else '"task"'
    rows = []
    for staleness, workers in predicted(task):
        reals = [real_run(task, staleness, workers, o, lock) for o in outs]
        found = [r for r in reals if r is not None]
        if not found:
            continue
        sim_dir = predict(found[0], hardware, lengths, out)
        rows.append({"task": task, "max_staleness": staleness, "workers": workers,
                     "real": mean_figures([figures(r) for r in found]),
                     "repeats": len(found), "sim": figures(sim_dir)})
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| task | max_staleness | workers | step train_s real | sim "
             "| groups/s real (repeats, spread) | sim | error "
             "| rollout idle real | sim | diff | trainer idle real | sim | diff "
             "| idle by cause, real/sim (points) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- | --- |"]
    for row in rows:
        real, sim = row["real"], row["sim"]
        error = sim["groups_per_s"] / real["groups_per_s"] - 1
        cells = [row["task"], str(row["max_staleness"]), str(row["workers"]),
                 f"{real['train_s']:.2f}", f"{sim['train_s']:.2f}",
                 f"{real['groups_per_s']:.2f} ({row['repeats']}, {real['spread']:.0%})",
                 f"{sim['groups_per_s']:.2f}", f"{error:+.0%}"]
        causes = []
        for role in ("rollout", "trainer"):
            r, s = real["roles"][role], sim["roles"][role]
            cells += [f"{r['idle']:.0%}", f"{s['idle']:.0%}",
                      f"{100 * (s['idle'] - r['idle']):+.0f}"]
            causes += [f"{role[0]}.{c} {100 * r[c]:.0f}/{100 * s.get(c, 0):.0f}"
                       for c in r if c != "idle" and max(r[c], s.get(c, 0)) >= 0.01]
        lines.append("| " + " | ".join([*cells, ", ".join(causes)]) + " |")
    return "\n".join(lines)


def summary_line(rows: Sequence[dict[str, Any]]) -> str:
    ok = 0
    for row in rows:
        real, sim = row["real"], row["sim"]
        good = abs(sim["groups_per_s"] / real["groups_per_s"] - 1) <= 0.15 and all(
            abs(sim["roles"][role]["idle"] - real["roles"][role]["idle"]) <= 0.10
            for role in ("rollout", "trainer"))
        ok += good
    return (f"{ok} of {len(rows)} predicted runs within 15% on groups/s and 10 points on "
            "both roles' idle fractions")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--tasks", default="default,longtail")
    parser.add_argument("--out", action="append",
                        help="real and simulated runs (default runs/sim-vs-real); given "
                             "again, a repeat of every real run: each predicted setting "
                             "is set against the mean of its repeats")
    parser.add_argument("--lock", default="", help="run each real run under flock FILE")
    parser.add_argument("--existing", action="store_true",
                        help="only the real runs already in --out: train none")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    logging.getLogger("async_rl").setLevel(logging.WARNING)
    outs = [Path(out) for out in args.out or ["runs/sim-vs-real"]]
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
    tasks = args.tasks.split(",")
    lock = None if args.existing else args.lock
    if lock is not None:
        train_all(tasks, outs, lock)
    rows = [row for task in tasks for row in compare(task, outs, lock)]
    if args.json:
        print(json.dumps(msgspec.to_builtins(rows)))
    else:
        print(table(rows))
        print(summary_line(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
