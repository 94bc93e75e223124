"""Benchmark: driver cost as tokens per step and rollout workers grow, by value vs by reference.

Drives the real ``async_rl.control.orchestrator.Orchestrator`` on real Ray through the real
``async_rl.shell.ray_shell`` adapters, against stub workers (bench/data/scale_stubs.py): rollout
stubs emit groups at a set total rate (``--rate`` groups/s, split evenly over the
workers) with lognormal (heavy-tailed) completion lengths and random token ids; trainer
stubs resolve their batch and sleep ``--ns-per-token`` per token. Nothing computes, so
what grows with the sweep is the data path and the orchestration.

Sweep: tokens per step in {10k, 100k, 1M, 10M} x rollout workers in {1, 4, 16}, each
point in two modes:

- after: the current path. The rollout stub ``ray.put``s the group's ``GroupTokens``
  (numpy arrays) and returns metadata with a reference; the driver plans from metadata
  and sends each shard slots plus references; the shard fetches the arrays itself.
- before: the data path before groups moved by reference (commit dc52a82). The rollout
  stub returns the tokens inline as the old ``Group`` held them — a ``Sample`` per
  sample with tuples of int token ids, float logprobs and int versions — so the driver
  unpickles every token; the driver-side trainer adapter then builds the old
  ``TrainSequence``s (tuples, as the old ``shard_batches`` did) and the driver pickles
  them again into each shard's batch. The old controller itself cannot run against
  stubs, so this reproduces its data path's cost inside the same orchestrator: the
  only difference between the modes is where the tokens travel.

The step's group count is fixed (``--groups-per-step`` x ``--group-size``, 64 x 16) and
sequence lengths scale to reach the token target (prompt an eighth of the mean sequence,
the rest completion). Scaling lengths, not groups, keeps the driver's per-group work
(admission, ledger, queue, plan) the same at every point, so the growth from 10k to 10M
is what the token volume costs the driver; more groups per step would raise both modes'
cost per step in proportion and hide it.

Per point and mode: driver CPU per step (``time.process_time()`` of this process, Ray's
driver-side threads included, from the end of step 1 to the end of the last step, per
step; the JSON also splits off the event loop's thread), that per group, end-to-end
groups/s over the same window, and the measured tokens per step. Step 1 is warm-up
(queue fill). The two modes of a point run back to back, in an order that alternates
between neighbouring points and between repeats (ABBA), so drift hits both alike; with
``--repeat`` the table shows per-figure medians. The machine is shared, so timings are
noisy. ``--max-before-tokens`` skips the before mode above that many tokens per step
(the old path builds Python tuples of every token). The actors start once for the sweep
(start-up is not measured) and are reset per point. Run it from the repository root, as below:
Ray's workers import ``bench.data.scale_stubs`` from the current directory.

    python -m bench.data.scale                  # full grid, 2 runs a point: about 7 minutes
    python -m bench.data.scale --quick          # 10k and 1M tokens x 1 and 4 workers, 1 run
    python -m bench.data.scale --tokens 10000 10000000 --workers 4 --repeat 1 --json
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec
import ray
from rich import box
from rich.console import Console
from rich.table import Table

from async_rl.config import Config, RunConfig
from async_rl.control.orchestrator import Orchestrator
from async_rl.control.protocols import PublishedWeights, TrainerClient, Workers
from async_rl.run.run_dir import RunWriter
from async_rl.shell.adapters import RayRollout, RayTrainer
from async_rl.tasks.sources import ArithmeticTask
from bench.common.quiet_stdout import stdout_to_stderr
from bench.data.scale_stubs import (
    StubRollout,
    StubSpec,
    StubTrainer,
    ValueSequence,
    ValueShardBatch,
    ValueTokens,
)
from buffers.common.concurrent_calls import each
from buffers.common.config import QueueConfig
from buffers.common.reports import BroadcastTiming
from buffers.common.train_records import SequenceSlot, ShardBatch, ShardStepResult
from workers.model_config import ModelConfig
from workers.rollout.config import RolloutConfig
from workers.trainer.config import TrainerConfig

MODES = ("after", "before")
TARGET_GROWTH = 1.5
"""Done-when: after-mode driver CPU per step grows at most this much from 10k to 10M."""
TARGET_MS_PER_GROUP = 2.0
"""Done-when: and stays under this many driver CPU ms per group."""


class PointFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One sweep point in one mode: one run's figures, or the medians of its runs."""

    mode: str
    tokens_target: int
    workers: int
    runs: int
    steps_measured: int
    """Per run."""
    tokens_per_step: float
    """Measured: mean over the measured steps (lengths are random)."""
    driver_cpu_s_per_step: float
    loop_cpu_s_per_step: float
    """Of which the event loop's thread (the orchestrator, and Ray's Python-side calls
    made from it); the rest is Ray's own threads in the driver process."""
    driver_cpu_ms_per_group: float
    groups_per_s: float
    wall_s: float
    """The measured window, per run."""

    @property
    def driver_cpu_ms_per_step(self) -> float:
        return self.driver_cpu_s_per_step * 1e3


class ByValueTrainer(RayTrainer):
    """The old data path's trainer side: the driver sends every token, as tuples.

    What the old ``shard_batches`` did: one ``TrainSequence`` per sample, sharing the
    group's tuples, so a shard's batch pickles only the samples it trains.
    """

    async def train(self, batch: ShardBatch) -> ShardStepResult:
        groups: Sequence[ValueTokens] = batch.groups

        def sequence(slot: SequenceSlot) -> ValueSequence:
            group = groups[slot.group]
            sample = group.samples[slot.sample]
            return ValueSequence(prompt_token_ids=group.prompt_token_ids,
                                 completion_token_ids=sample.token_ids,
                                 behaviour_logprobs=sample.logprobs, advantage=slot.advantage)

        micro_batches = tuple(tuple(sequence(slot) for slot in micro_batch)
                              for micro_batch in batch.micro_batches)
        result: ShardStepResult = await self.handle.train_step_by_value.remote(
            ValueShardBatch(step=batch.step, micro_batches=micro_batches))
        return result


class StubPublished(msgspec.Struct, frozen=True, kw_only=True):
    version: int


class StubWeights:
    """A ``WeightPath`` that moves no weights: delivery sets the stubs' version."""

    def __init__(self, rollout: dict[int, Any]) -> None:
        self.rollout = rollout

    async def publish(self, version: int) -> StubPublished:
        return StubPublished(version=version)

    async def deliver(self, published: PublishedWeights, ranks: Sequence[int]
                      ) -> tuple[list[BroadcastTiming], list[int]]:
        v = published.version
        await each([lambda r=r: self.rollout[r].set_version.remote(v)  # type: ignore[misc]
                    for r in ranks])
        return [BroadcastTiming(version=v, rollout_rank=r, publish_s=0.0, transfer_s=0.0,
                                pause_s=0.0, load_s=0.0) for r in ranks], []


class StepMarks:
    """The driver's clocks as each step's row lands (``RunWriter``'s ``on_metrics``)."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float, float, int]] = []
        """(wall, driver CPU, event-loop thread CPU, tokens) per step, in step order."""

    def __call__(self, row: dict[str, Any]) -> None:
        # Called on the event loop's thread, so thread_time() is that thread's CPU.
        self.marks.append((time.perf_counter(), time.process_time(), time.thread_time(),
                           row["tokens"]))


def run_point(mode: str, tokens: int, workers: int, args: argparse.Namespace,
              rollout: list[Any], trainers: list[Any]) -> PointFigures:
    """One point in one mode on the first ``workers`` rollout stubs; figures of steps 2+."""
    spec = StubSpec.for_tokens(tokens, args.groups_per_step, args.group_size, args.sigma,
                               by_value=mode == "before", groups_per_s=args.rate / workers,
                               seed=args.seed)
    handles = dict(enumerate(rollout[:workers]))
    ray.get([h.reset.remote(spec) for h in handles.values()])
    cap = max(4096, spec.prompt_length + spec.max_completion)
    config = Config(
        model=ModelConfig(path="stub"),
        rollout=RolloutConfig(num_workers=workers, group_size=args.group_size,
                              max_new_tokens=spec.max_completion),
        # Room for a step in flight and a step queued, however long the groups.
        queue=QueueConfig(max_groups=2 * args.groups_per_step,
                          max_tokens=4 * tokens + args.group_size * cap),
        trainer=TrainerConfig(num_shards=args.shards, groups_per_step=args.groups_per_step,
                              micro_batch_tokens=cap),
        run=RunConfig(num_steps=args.steps, progress=False, eval_every=0),
    )
    trainer_type = ByValueTrainer if mode == "before" else RayTrainer
    clients: list[TrainerClient] = [trainer_type(i, h, config)
                                    for i, h in enumerate(trainers)]
    gc.collect()  # the previous point's garbage is not this point's cost
    with tempfile.TemporaryDirectory(prefix="async-rl-scale-") as out_dir:
        steps = StepMarks()
        out = RunWriter(out_dir, config, on_metrics=steps)
        orchestrator = Orchestrator(
            config, out, ArithmeticTask(seed=args.seed), (),
            Workers(rollout={r: RayRollout(f"rollout-{r}", h, config) for r, h in handles.items()},
                    trainers=clients, weights=StubWeights(handles)))
        anyio.run(orchestrator.run)
    ray.get([h.quiesce.remote() for h in handles.values()])
    (wall0, cpu0, loop0, _), (wall1, cpu1, loop1, _) = steps.marks[0], steps.marks[-1]
    measured = len(steps.marks) - 1
    cpu_per_step = (cpu1 - cpu0) / measured
    return PointFigures(
        mode=mode, tokens_target=tokens, workers=workers, runs=1, steps_measured=measured,
        tokens_per_step=statistics.mean(n for *_, n in steps.marks[1:]),
        driver_cpu_s_per_step=cpu_per_step, loop_cpu_s_per_step=(loop1 - loop0) / measured,
        driver_cpu_ms_per_group=cpu_per_step / args.groups_per_step * 1e3,
        groups_per_s=args.groups_per_step * measured / (wall1 - wall0), wall_s=wall1 - wall0)


def sweep(args: argparse.Namespace) -> list[PointFigures]:
    """Every run of the grid, in the order they ran."""
    # num_cpus=0: 16 stubs that mostly sleep share the cores with the driver.
    rollout: list[Any] = [ray.remote(num_cpus=0)(StubRollout).remote(rank)
                          for rank in range(max(args.workers))]
    trainers: list[Any] = [ray.remote(num_cpus=0)(StubTrainer).remote(rank, args.ns_per_token)
                           for rank in range(args.shards)]
    # Every actor up before the first point: start-up is not what is measured.
    ray.get([h.version.remote() for h in rollout] + [h.mean_cores.remote() for h in trainers])
    runs = []
    points = [(t, w) for t in args.tokens for w in args.workers]
    for i, (tokens, workers) in enumerate(points * args.repeat):
        modes = [m for m in MODES if m == "after" or tokens <= args.max_before_tokens]
        # ABBA: the order flips from one run of a point to the next, and between
        # neighbouring points.
        flip = (i % len(points) + i // len(points)) % 2
        for mode in modes[::-1] if flip else modes:
            run = run_point(mode, tokens, workers, args, rollout, trainers)
            print(f"{mode:6} {tokens:>10,} tokens/step {workers:>2} workers: "
                  f"{run.driver_cpu_ms_per_step:8.1f} ms driver CPU/step, "
                  f"{run.groups_per_s:7.1f} groups/s", flush=True)
            runs.append(run)
    return runs


def medians(runs: Sequence[PointFigures]) -> list[PointFigures]:
    """One record per point and mode: each figure the median over that point's runs."""
    keyed: dict[tuple[str, int, int], list[PointFigures]] = {}
    for run in runs:
        keyed.setdefault((run.mode, run.tokens_target, run.workers), []).append(run)
    return [
        PointFigures(
            mode=mode, tokens_target=tokens, workers=workers, runs=len(group),
            steps_measured=group[0].steps_measured,
            **{field: statistics.median(getattr(r, field) for r in group)
               for field in ("tokens_per_step", "driver_cpu_s_per_step", "loop_cpu_s_per_step",
                             "driver_cpu_ms_per_group", "groups_per_s", "wall_s")})
        for (mode, tokens, workers), group in keyed.items()
    ]


def growth(figures: Sequence[PointFigures], mode: str, workers: int) -> float | None:
    """Driver CPU per step at the largest token count over that at the smallest."""
    points = sorted((f for f in figures if f.mode == mode and f.workers == workers),
                    key=lambda f: f.tokens_target)
    if len(points) < 2:
        return None
    return points[-1].driver_cpu_s_per_step / points[0].driver_cpu_s_per_step


def _count(n: float) -> str:
    """10.0k, 1.00M: short enough for a table column."""
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def show(figures: Sequence[PointFigures], args: argparse.Namespace) -> None:
    by_key = {(f.mode, f.tokens_target, f.workers): f for f in figures}
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=(
        f"driver CPU per step, {args.groups_per_step} groups x {args.group_size} samples, "
        f"{args.shards} trainer shards, rollout {args.rate:g} groups/s in all"))
    table.caption = ("tokens: measured per step (after mode); ms/step, ms/grp: driver CPU "
                     "per step, per group; grp/s: groups trained per second")
    for column in ("tokens", "workers", "before\nms/step", "after\nms/step", "after/\nbefore",
                   "after\nms/grp", "before\ngrp/s", "after\ngrp/s"):
        table.add_column(column, justify="right")
    for tokens in args.tokens:
        for workers in args.workers:
            after, before = by_key[("after", tokens, workers)], by_key.get(("before", tokens,
                                                                            workers))
            ratio = after.driver_cpu_s_per_step / before.driver_cpu_s_per_step if before else None
            table.add_row(
                _count(after.tokens_per_step), str(workers),
                f"{before.driver_cpu_ms_per_step:.1f}" if before else "-",
                f"{after.driver_cpu_ms_per_step:.1f}",
                f"{ratio:.2f}" if ratio is not None else "-",
                f"{after.driver_cpu_ms_per_group:.2f}",
                f"{before.groups_per_s:.1f}" if before else "-",
                f"{after.groups_per_s:.1f}")
    console = Console()
    console.print(table)
    low, high = min(args.tokens), max(args.tokens)
    growth_table = Table(box=box.SIMPLE_HEAD,
                         title=f"driver CPU per step, {_count(high)} over {_count(low)} tokens")
    for column in ("workers", "before", "after"):
        growth_table.add_column(column, justify="right")
    for workers in args.workers:
        growths = [growth(figures, mode, workers) for mode in ("before", "after")]
        growth_table.add_row(str(workers),
                             *(f"{g:.2f}x" if g is not None else "-" for g in growths))
    console.print(growth_table)
    after_growths = [g for w in args.workers if (g := growth(figures, "after", w)) is not None]
    worst_ms = max(f.driver_cpu_ms_per_group for f in figures if f.mode == "after")
    if after_growths:
        worst = max(after_growths)
        console.print(f"after: driver CPU per step grows at most {worst:.2f}x "
                      f"(target <= {TARGET_GROWTH}x: "
                      f"{'met' if worst <= TARGET_GROWTH else 'NOT met'})")
    console.print(f"after: driver CPU per group at most {worst_ms:.2f} ms "
                  f"(target < {TARGET_MS_PER_GROUP} ms: "
                  f"{'met' if worst_ms < TARGET_MS_PER_GROUP else 'NOT met'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+",
                        default=[10_000, 100_000, 1_000_000, 10_000_000])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--quick", action="store_true",
                        help="10k and 1M tokens x 1 and 4 workers, 4 steps, 1 run")
    parser.add_argument("--steps", type=int, default=8, help="per point; the first is warm-up")
    parser.add_argument("--groups-per-step", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--shards", type=int, default=2, help="trainer stubs")
    parser.add_argument("--rate", type=float, default=256.0,
                        help="groups/s all rollout stubs emit together")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal length shape")
    parser.add_argument("--ns-per-token", type=float, default=10.0,
                        help="trainer stub sleep per token")
    parser.add_argument("--max-before-tokens", type=int, default=10_000_000,
                        help="skip the before mode above this many tokens per step")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs per point and mode (ABBA); the table shows medians")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.workers, args.steps, args.repeat = [10_000, 1_000_000], [1, 4], 4, 1
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first is warm-up)")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    with stdout_to_stderr(args.json):
        # "local": a fresh cluster of its own, even when another one runs on the machine.
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
                 _node_ip_address="127.0.0.1", logging_level=logging.WARNING)
        try:
            runs = sweep(args)
        finally:
            ray.shutdown()
    figures = medians(runs)
    if args.json:
        print(msgspec.json.encode({
            "config": vars(args), "points": figures, "runs": runs,
            "growth": {mode: {str(w): growth(figures, mode, w) for w in args.workers}
                       for mode in MODES},
        }).decode())
        return
    show(figures, args)


if __name__ == "__main__":
    main()
