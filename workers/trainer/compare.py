"""One trainer setup run on a fixed batch, each shard in a fresh process of its own.

Owns: ``run_setup``, which starts ``trainer.num_shards`` processes (spawned: each one
imports torch itself, so its peak memory is the setup's own), each one a
``TrainerShard`` used directly (no Ray) that trains its ``ShardBatch`` for one warm-up
step and then the timed steps, and reports its ``ShardFigures``: step times, each
step's result, its RSS after setup and its peak RSS, and on shard 0 the largest
parameter difference to a reference state (the first setup's, which shard 0 writes).
Knows nothing about configs as a whole, how the batch was made, tables or agreement
(``async_rl.compare`` has those).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from buffers.common.train_records import ShardBatch, ShardStepResult
from workers.common.ports import free_port
from workers.model_config import ModelConfig
from workers.rollout.config import RolloutConfig, Sampling
from workers.trainer.config import TrainerConfig
from workers.trainer.spec import TrainerSpec


class ShardFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What one shard of a setup measured."""

    rank: int
    step_s: list[float]
    """Wall time of each timed step (the warm-up step is not timed)."""
    results: list[ShardStepResult]
    """Every step's result, the warm-up's first."""
    rss_setup_mb: float
    """RSS once the model and optimizer are built."""
    peak_rss_mb: float
    """Peak RSS (``ru_maxrss``) over building and every step, before the weights are
    gathered for the comparison."""
    parameters: int
    max_param_diff: float | None = None
    """Shard 0 of a setup given a reference: the largest absolute difference of any
    parameter to it after the steps."""


class SetupFailed(RuntimeError):
    """A shard process of a setup exited before it reported."""


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _max_diff(state: dict[str, Any], reference: Path) -> float:
    import torch

    other = torch.load(reference, mmap=True, weights_only=True)
    return max(float((state[k].float() - other[k].float()).abs().max())
               for k in other if k in state)


def _shard(rank: int, world: int, port: int, model: ModelConfig, trainer: TrainerConfig,
           rollout: RolloutConfig, seed: int, batch: ShardBatch, steps: int,
           reference: str, out: Any) -> None:
    """One shard's process: builds, trains ``steps + 1`` steps, reports its figures."""
    import torch

    from workers.trainer.shard import TrainerShard

    torch.set_num_threads(trainer.cpus_per_shard)
    shard = TrainerShard(TrainerSpec(
        rank=rank, world_size=world, model=model, trainer=trainer, seed=seed,
        sampling=Sampling(temperature=rollout.temperature,
                          max_new_tokens=rollout.max_new_tokens),
        master_port=port, record_spans=False))
    shard.setup()
    rss_setup = _rss_mb()
    tokens = list(batch.groups)  # in-process: the groups hold their own tokens
    times, results = [], []
    for index in range(steps + 1):
        began = time.perf_counter()
        results.append(shard.train_step(batch, tokens))
        if index:  # the first is a warm-up (first-call allocations)
            times.append(time.perf_counter() - began)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    parameters = sum(p.numel() for p in shard.module.parameters())
    state = shard.policy_state()  # with fsdp2 every shard takes part; shard 0 holds it
    diff = None
    if state and rank == 0:  # ddp's other replicas hold the same weights
        path = Path(reference)
        if path.is_file():
            diff = _max_diff(state, path)
        else:  # the first setup: its weights are the reference, renamed in once whole
            partial = path.with_suffix(".partial")
            torch.save({k: v.clone() for k, v in state.items()}, partial)
            partial.replace(path)
    del state
    shard.shutdown()
    out.put(msgspec.json.encode(ShardFigures(
        rank=rank, step_s=times, results=results, rss_setup_mb=rss_setup, peak_rss_mb=peak,
        parameters=parameters, max_param_diff=diff)))


def run_setup(*, model: ModelConfig, trainer: TrainerConfig, rollout: RolloutConfig,
              seed: int, batches: Sequence[ShardBatch], steps: int, reference: Path,
              timeout_s: float) -> list[ShardFigures]:
    """Trains ``batches`` (one per shard, planned for ``trainer.num_shards``) for one
    warm-up step and ``steps`` timed ones, each shard in a fresh process; returns the
    shards' figures by rank. ``reference``: where the first setup's shard 0 writes its
    final weights and later setups read them. Raises ``SetupFailed`` when a shard exits
    without reporting, or none reports within ``timeout_s``."""
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    procs = [context.Process(target=_shard, daemon=True, args=(
        rank, len(batches), port, model, trainer, rollout, seed, batch, steps,
        str(reference), out)) for rank, batch in enumerate(batches)]
    for p in procs:
        p.start()
    figures: list[ShardFigures] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(figures) < len(procs):
            try:
                figures.append(msgspec.json.decode(out.get(timeout=1.0), type=ShardFigures))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise SetupFailed(f"shard {dead[0]} exited {procs[dead[0]].exitcode}"
                                      " before it reported") from None
                if time.monotonic() > deadline:
                    raise SetupFailed(f"no report within {timeout_s:.0f}s") from None
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return sorted(figures, key=lambda f: f.rank)
