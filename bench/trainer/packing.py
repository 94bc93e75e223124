"""Benchmark: a trainer step with padded vs packed micro-batches on long-tail lengths.

One ``TrainerShard`` step (forward, backward, AdamW) over 128 sequences whose lengths
are those of the long-tail task's reference traces (``async_rl.tasks.longtail.RemainderTask``:
prompts about 6 tokens, completions median about 20, 99th percentile about 210), planned
into micro-batches the way a run plans them (``buffers.plan.balance.plan_step``, first-fit-
decreasing under ``--cap`` tokens). The model is ``--size`` (default ``small``, the CPU
default's) as initialised; torch on one thread.

- padded: each micro-batch is one right-padded row per sequence (the layout before);
- packed: each micro-batch is one row of its sequences end to end, attention per sequence.

The two alternate (padded, packed, padded, ...) after one warm-up step each, so load
from other processes hits both alike; the figures are medians. It also times one AdamW
step over the model's parameters with the default per-tensor loop and ``fused=True``.

    python -m bench.trainer.packing [--repeats 2] [--cap 2048] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from async_rl.tasks.synthetic import long_tail_groups
from bench.common.quiet_stdout import stdout_to_stderr

if TYPE_CHECKING:
    import torch


class LayoutFigures(msgspec.Struct, frozen=True, kw_only=True):
    layout: str
    step_s: float
    """Median wall time of one train_step."""
    forward_s: float
    backward_s: float
    optimizer_s: float
    computed_positions: int
    padding_ratio: float
    """Computed positions / real tokens."""


class PackingFigures(msgspec.Struct, frozen=True, kw_only=True):
    size: str
    sequences: int
    real_tokens: int
    completion_tokens: int
    micro_batches: int
    cap: int
    repeats: int
    padded: LayoutFigures
    packed: LayoutFigures
    speedup: float
    """Padded step time / packed step time."""
    adamw_default_ms: float
    adamw_fused_ms: float


def time_adamw(model: torch.nn.Module, fused: bool, repeats: int = 10) -> float:
    import torch

    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-5, fused=fused)
    opt.step()
    began = time.perf_counter()
    for _ in range(repeats):
        opt.step()
    return (time.perf_counter() - began) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per layout")
    parser.add_argument("--cap", type=int, default=2048, help="micro-batch token cap")
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--size", default="small", help="tiny | small")
    args = parser.parse_args()

    import torch
    from transformers import Qwen2ForCausalLM

    from async_rl.models.tiny_model import MODEL_SIZES, size_config
    from buffers.common.train_records import ShardStepResult
    from buffers.plan.batching import shard_batches
    from workers.model_config import ModelConfig
    from workers.trainer.config import TrainerConfig
    from workers.trainer.shard import TrainerShard
    from workers.trainer.spec import TrainerSpec

    torch.set_num_threads(1)
    groups = long_tail_groups(args.sequences, seed=0)
    lengths = [n for g in groups for n in g.sequence_lengths]
    (batch,), plan = shard_batches(groups, 1, TrainerConfig(micro_batch_tokens=args.cap),
                                   step=1)
    tokens = list(batch.groups)  # in-process: the groups hold their own tokens
    with stdout_to_stderr(args.json), \
            tempfile.TemporaryDirectory(prefix="async-rl-bench-") as root:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(size_config(MODEL_SIZES[args.size]))
        model.save_pretrained(Path(root))
        shards = {}
        for layout in ("padded", "packed"):
            trainer = TrainerConfig(micro_batch_tokens=args.cap, packed=layout == "packed")
            shard = TrainerShard(TrainerSpec(
                rank=0, world_size=1, model=ModelConfig(path=root), trainer=trainer, seed=0,
                record_spans=False))
            shard.setup()
            shard.train_step(batch, tokens)  # warm-up: first-call allocations
            shards[layout] = shard
        runs: dict[str, list[tuple[float, ShardStepResult]]] = {"padded": [], "packed": []}
        for _ in range(args.repeats):
            for layout, shard in shards.items():
                began = time.perf_counter()
                result = shard.train_step(batch, tokens)
                runs[layout].append((time.perf_counter() - began, result))
        default_ms = statistics.median(time_adamw(model, fused=False) for _ in range(3))
        fused_ms = statistics.median(time_adamw(model, fused=True) for _ in range(3))

    def figures(layout: str) -> LayoutFigures:
        done = runs[layout]
        last = done[-1][1]
        return LayoutFigures(
            layout=layout,
            step_s=statistics.median(t for t, _ in done),
            forward_s=statistics.median(r.forward_s for _, r in done),
            backward_s=statistics.median(r.backward_s for _, r in done),
            optimizer_s=statistics.median(r.optimizer_s for _, r in done),
            computed_positions=last.computed_positions,
            padding_ratio=last.padding_ratio)

    padded, packed = figures("padded"), figures("packed")
    out = PackingFigures(
        size=args.size, sequences=len(lengths), real_tokens=sum(lengths),
        completion_tokens=sum(sum(g.completion_lengths) for g in groups),
        micro_batches=plan.num_micro_batches, cap=args.cap, repeats=args.repeats,
        padded=padded, packed=packed, speedup=padded.step_s / packed.step_s,
        adamw_default_ms=default_ms, adamw_fused_ms=fused_ms)
    if args.json:
        print(msgspec.json.encode(out).decode())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=(
        f"train step, {out.sequences} long-tail sequences ({out.real_tokens} tokens), "
        f"{out.micro_batches} micro-batches <= {out.cap} tokens, {out.size} model, 1 thread"))
    for column in ("layout", "positions", "padding ratio", "forward s", "backward s",
                   "optimizer s", "step s"):
        table.add_column(column, justify="right")
    for r in (padded, packed):
        table.add_row(r.layout, str(r.computed_positions), f"{r.padding_ratio:.2f}",
                      f"{r.forward_s:.3f}", f"{r.backward_s:.3f}", f"{r.optimizer_s:.3f}",
                      f"{r.step_s:.3f}")
    console = Console()
    console.print(table)
    console.print(f"packed is {out.speedup:.2f}x faster per step; AdamW step "
                  f"{out.adamw_default_ms:.1f} ms default vs {out.adamw_fused_ms:.1f} ms fused")


if __name__ == "__main__":
    main()
