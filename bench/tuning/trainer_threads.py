"""Benchmark: does the trainer shard gain from a second thread on the rollout engine's core?

The question behind "the trainer's thread count may follow the engines' idle time":
on a CPU machine whose rollout engine waits (at the staleness gate, on a full queue),
the engine's core is free, and the trainer shard could take it for a second torch
thread. Before building a controller that moves the thread count with the engine's
idle time, this measures the two static ends on the same config (``--config``,
``--steps`` steps, A B B A; ``--once``: A B, with ``--reverse`` B A):
A ``1 thread`` (``trainer.cpus_per_shard = 1``: its own core, as the config has it),
B ``2 threads`` (``trainer.cpus_per_shard = 2``: on a 2-core machine its second core
is the engine's, ``workers.layout.assign_cpus``'s round-robin; two torch threads).
B is the most a thread count that follows the engine's idle time could take: when
the engine idles it trains on both cores, as the controller would; when the engine
generates the two contend, which the controller would avoid. The other bound, the
step alone with the second core idle, is ``bench/trainer/trainer_step.py --threads``.

Per run: groups/s over the second half of the steps (the metrics rows' groups over
their wait, train and sync seconds, as ``autopilot_vs_static`` measures it), over the
whole run (``summary.json``), the trainer's seconds of compute (the rows' ``train_s``)
and its wait for data (``wait_s``), and from its spans the seconds the engines idled
while the trainer computed (forward, backward, optimizer): all a thread count that
followed the engines' idle time could speed up (``idle_overlap``). Last line:
``trainer_threads: 2 threads / 1 thread R1 (second half), R2 (whole run), train_s R3``,
of the runs' means.

    python -m bench.tuning.trainer_threads --config examples/cpu_longtail.toml \\
        --lock /tmp/async-rl-heavy.lock --set run.progress=false
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from statistics import mean

from async_rl.analysis.report import read_spans
from async_rl.run.run_dir import read_metrics, read_summary
from bench.tuning.autopilot_vs_static import second_half
from bench.tuning.runs import add_order_options, add_run_options, ordered_runs, train
from workers.common.spans import Span

SETUPS = {"1 thread": ("trainer.cpus_per_shard=1",),
          "2 threads": ("trainer.cpus_per_shard=2",)}


def trainer_seconds(run_dir: Path) -> tuple[float, float]:
    """(compute, wait for data): the trainer's seconds over the run's metrics rows."""
    rows = read_metrics(run_dir)
    return sum(r["train_s"] for r in rows), sum(r["wait_s"] for r in rows)


COMPUTE = frozenset({"forward", "backward", "optimizer"})
"""A trainer shard's causes of compute (what a second thread would speed up)."""


def _merged(spans: Sequence[Span]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted((s.start, s.end) for s in spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def idle_overlap(spans: Sequence[Span]) -> tuple[float, float, float]:
    """(every engine idle, the trainer shards computing, both at once), in seconds of
    the run's spans: "idle" spans of the rollout workers when all of them idle (a core
    free for a trainer thread), and the trainer shards' compute."""
    engines = sorted({s.worker for s in spans if s.role == "rollout"})
    idle = _merged([s for s in spans if s.role == "rollout" and s.cause == "idle"])
    if len(engines) > 1:  # a core is free only while every engine idles: not measured here
        idle = []
    compute = _merged([s for s in spans if s.role == "trainer" and s.cause in COMPUTE])
    both, i, j = 0.0, 0, 0
    while i < len(idle) and j < len(compute):
        both += max(0.0, min(idle[i][1], compute[j][1]) - max(idle[i][0], compute[j][0]))
        if idle[i][1] < compute[j][1]:
            i += 1
        else:
            j += 1
    return (sum(b - a for a, b in idle), sum(b - a for a, b in compute), both)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/cpu_longtail.toml")
    parser.add_argument("--steps", type=int, default=60, help="run.num_steps of every run")
    parser.add_argument("--out", default="runs/trainer-threads", help="where runs go")
    add_order_options(parser)
    add_run_options(parser)
    args = parser.parse_args(argv)
    halves: dict[str, list[float]] = {name: [] for name in SETUPS}
    wholes: dict[str, list[float]] = {name: [] for name in SETUPS}
    trains: dict[str, list[float]] = {name: [] for name in SETUPS}
    for name, run_dir in ordered_runs(list(SETUPS), args.out, args.once, args.reverse):
        train(args.config, run_dir, args.steps, [*args.sets, *SETUPS[name]], args.lock)
        half, whole = second_half(run_dir), read_summary(run_dir).groups_per_s
        compute, waited = trainer_seconds(run_dir)
        idle, computing, both = idle_overlap(read_spans(run_dir))
        halves[name].append(half)
        wholes[name].append(whole)
        trains[name].append(compute)
        print(f"{name}: second half {half:.2f} groups/s, whole run {whole:.2f}; trainer "
              f"computed {compute:.1f} s, waited for data {waited:.1f} s; spans: the "
              f"engine idled {idle:.1f} s, the trainer computed {computing:.1f} s, "
              f"both at once {both:.1f} s", flush=True)
    a, b = SETUPS
    print(f"trainer_threads: 2 threads / 1 thread {mean(halves[b]) / mean(halves[a]):.2f} "
          f"(second half), {mean(wholes[b]) / mean(wholes[a]):.2f} (whole run), "
          f"train_s {mean(trains[b]) / mean(trains[a]):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
