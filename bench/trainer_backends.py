"""Benchmark: the same training steps on ddp, fsdp2 and fsdp2 with CPU offload, side by side.

Each setup trains the same fixed batch (long-tail-shaped sequences: ``bench/packing.py``'s
``long_tail_groups``, planned for ``--shards`` shards the way a run plans a step) for
``--steps`` steps after one warm-up step, from the same randomly initialised model
(``--size``, optionally widened with ``--hidden`` / ``--layers``), at the same shard
count and precision, each shard in a fresh process of its own with one torch thread
(``TrainerShard`` directly: no Ray), so that peak memory is the setup's own. Per setup it
prints the median step time, each shard's peak RSS (``ru_maxrss``) and its RSS after
setup, the loss and gradient norm of every step, and the largest parameter difference
to the first setup after the steps; ratios are to the first setup.

    PYTHONPATH=. python bench/trainer_backends.py [--size small] [--shards 2] [--steps 3]
        [--setups ddp fsdp2 fsdp2-offload] [--hidden 512 --layers 8] [--json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from packing import long_tail_groups
from quiet_stdout import stdout_to_stderr

SETUPS: dict[str, dict[str, Any]] = {
    "ddp": {"backend": "ddp"},
    "fsdp2": {"backend": "fsdp2"},
    "fsdp2-offload": {"backend": "fsdp2", "offload": True},
    "fsdp2-bf16": {"backend": "fsdp2", "param_dtype": "bfloat16", "reduce_dtype": "float32"},
}


class ShardFigures(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    step_s: list[float]
    losses: list[float]
    """Per step: this shard's loss sum (the step's loss is the sum over shards / tokens)."""
    tokens: int
    grad_norms: list[float]
    rss_setup_mb: float
    peak_rss_mb: float


class SetupFigures(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    trainer: dict[str, Any]
    step_s: float
    """Median over the timed steps of the slowest shard's step."""
    peak_rss_mb: list[float]
    rss_setup_mb: list[float]
    losses: list[float]
    grad_norms: list[float]
    max_param_diff: float
    """Largest absolute parameter difference to the first setup after the steps."""


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _shard(rank: int, world: int, port: int, root: str, name: str,
           trainer: Any, batch: Any, steps: int, out: Any) -> None:
    import torch

    from workers.model_config import ModelConfig
    from workers.trainer.shard import TrainerShard

    torch.set_num_threads(1)
    shard = TrainerShard(rank=rank, world_size=world, model=ModelConfig(path=root),
                         trainer=trainer, seed=0, master_port=port, record_spans=False)
    shard.setup()
    rss_setup = _rss_mb()
    tokens = list(batch.groups)  # in-process: the groups hold their own tokens
    times, losses, norms = [], [], []
    for index in range(steps + 1):
        began = time.perf_counter()
        result = shard.train_step(batch, tokens)
        if index:  # the first is a warm-up (first-call allocations)
            times.append(time.perf_counter() - began)
            losses.append(result.loss.loss_sum)
            norms.append(result.grad_norm)
    state = shard.policy_state()  # with fsdp2 every shard takes part; rank 0 holds it
    if state:
        torch.save({k: v.clone() for k, v in state.items()}, Path(root) / f"{name}.pt")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    shard.shutdown()
    out.put(msgspec.json.encode(ShardFigures(
        rank=rank, step_s=times, losses=losses, tokens=result.loss.tokens, grad_norms=norms,
        rss_setup_mb=rss_setup, peak_rss_mb=peak)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_setup(name: str, root: str, groups: list[Any], shards: int, steps: int,
              cap: int) -> list[ShardFigures]:
    from async_rl.control.batching import shard_batches
    from workers.trainer.config import TrainerConfig

    trainer = TrainerConfig(num_shards=shards, groups_per_step=len(groups),
                            micro_batch_tokens=cap, **SETUPS[name])
    batches, _ = shard_batches(groups, shards, trainer, step=1)
    context = mp.get_context("spawn")
    out = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_shard, args=(rank, shards, port, root, name, trainer,
                                                  batches[rank], steps, out))
             for rank in range(shards)]
    for p in procs:
        p.start()
    figures = [msgspec.json.decode(out.get(timeout=600), type=ShardFigures) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"{name}: a shard exited {p.exitcode}")
    return sorted(figures, key=lambda f: f.rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--size", default="small", help="tiny | small")
    parser.add_argument("--hidden", type=int, default=0, help="hidden size (0: the size's)")
    parser.add_argument("--layers", type=int, default=0, help="layers (0: the size's)")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setup")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--cap", type=int, default=1024, help="micro-batch token cap")
    parser.add_argument("--setups", nargs="+", default=["ddp", "fsdp2", "fsdp2-offload"],
                        choices=sorted(SETUPS))
    args = parser.parse_args()

    import torch
    from transformers import Qwen2ForCausalLM

    from async_rl.models.tiny_model import MODEL_SIZES, size_config

    size = MODEL_SIZES[args.size]
    size = msgspec.structs.replace(
        size, hidden_size=args.hidden or size.hidden_size,
        intermediate_size=4 * args.hidden if args.hidden else size.intermediate_size,
        num_layers=args.layers or size.num_layers)
    groups = long_tail_groups(args.sequences, seed=0)
    results: list[SetupFigures] = []
    with stdout_to_stderr(args.json), \
            tempfile.TemporaryDirectory(prefix="async-rl-bench-") as root:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(size_config(size))
        parameters = sum(p.numel() for p in model.parameters())
        model.save_pretrained(Path(root))
        del model
        for name in args.setups:
            shards = run_setup(name, root, groups, args.shards, args.steps, args.cap)
            tokens = sum(s.tokens for s in shards)
            mine = torch.load(Path(root) / f"{name}.pt")
            first = torch.load(Path(root) / f"{args.setups[0]}.pt")
            results.append(SetupFigures(
                name=name, trainer=SETUPS[name],
                step_s=statistics.median(max(t) for t in zip(*(s.step_s for s in shards),
                                                             strict=True)),
                peak_rss_mb=[s.peak_rss_mb for s in shards],
                rss_setup_mb=[s.rss_setup_mb for s in shards],
                losses=[sum(v) / tokens for v in zip(*(s.losses for s in shards),
                                                     strict=True)],
                grad_norms=shards[0].grad_norms,
                max_param_diff=max(float((mine[k].float() - first[k].float()).abs().max())
                                   for k in first)))
    if args.json:
        print(msgspec.json.encode({"parameters": parameters, "shards": args.shards,
                                   "setups": results}).decode())
        return
    from rich.console import Console
    from rich.table import Table

    base = results[0]
    table = Table(title=(
        f"{args.steps} steps of the same {args.sequences} long-tail sequences, "
        f"{parameters / 1e6:.1f}M parameters, {args.shards} shards x 1 thread, fp32"))
    for column in ("setup", "step s", "x", "peak RSS MB/shard", "x", "RSS after setup MB",
                   "losses", "grad norms", "max |dparam|"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r.name, f"{r.step_s:.3f}", f"{r.step_s / base.step_s:.2f}",
            "/".join(f"{m:.0f}" for m in r.peak_rss_mb),
            f"{max(r.peak_rss_mb) / max(base.peak_rss_mb):.2f}",
            "/".join(f"{m:.0f}" for m in r.rss_setup_mb),
            " ".join(f"{v:.5f}" for v in r.losses), " ".join(f"{v:.4f}" for v in r.grad_norms),
            f"{r.max_param_diff:.2g}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
