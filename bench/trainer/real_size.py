"""Benchmark: a few async GRPO steps with a real-size model (Qwen2.5-0.5B's shape) on this
machine, to see what each stage costs at 358M parameters instead of 4M.

The model is ``async-rl make-model --size 0.5b`` (random weights: the figures are speed
and memory, not learning). The engine runs bf16 (``rollout.dtype``), the trainer keeps
float32 master weights and AdamW state, so every publish casts the weights to bf16. The
trainer computes in float32 unless ``--compute-dtype bfloat16`` (bf16 autocast): on this
machine's CPU that made the first step's backward take 597 s for 588 tokens
(docs/benchmarks.md, Real-size model). Per step it prints:

- completion tokens per second of the step's wall time (rollout bounds it here);
- train time (the trainer's forward, backward and optimizer);
- the weight update: publish (the trainer's snapshot), transfer (the bytes on the wire)
  and load, and the transfer's bandwidth against this machine's one-thread memcpy,
  measured here first;
- what each checkpoint (``run.checkpoint_every = 2``) cost the trainer: the seconds of
  its idle cause ``checkpoint`` (the shard snapshots its state; a thread writes the copy
  beside the next steps), and that against the step's time;

then the newest checkpoint's read time (what ``--resume`` costs the trainer: the
weights and the optimizer state) and the peak RSS of each worker's process tree (a
rollout worker's includes its vLLM engine processes), sampled every 0.5 s.

    python -m bench.trainer.real_size [--steps 5] [--model runs/model-0.5b]
        [--compute-dtype float32|bfloat16] [--json]

Not in CI: it takes several minutes and about 12 GB of memory.
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time
from pathlib import Path

import msgspec
import psutil
from rich.console import Console
from rich.table import Table

from async_rl.config import Config
from async_rl.config_io import decode_config
from async_rl.run.run_dir import METRICS, WORKERS
from bench.common.quiet_stdout import show, stdout_to_stderr

MEMCPY_MB = 256


class StepRow(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    completion_tokens: int
    step_s: float
    completion_tok_per_s: float
    train_s: float
    publish_s: float
    transfer_s: float
    load_s: float
    transfer_gb_per_s: float
    """Bytes of one update (the bf16 weights) over its transfer time."""
    checkpoint_s: float | None
    """Seconds the trainer spent on the checkpoint of this step (idle cause
    ``checkpoint``: its snapshot; the write runs beside the next steps)."""


class Result(msgspec.Struct, frozen=True, kw_only=True):
    parameters: int
    update_bytes: int
    memcpy_gb_per_s: float
    steps: list[StepRow]
    checkpoint_gb: float
    checkpoint_read_s: float
    peak_rss_gb: dict[str, float]
    wall_s: float


def memcpy_gb_per_s() -> float:
    """One-thread copy bandwidth of a ``MEMCPY_MB`` buffer (best of 5; read + write
    counted once, as a transfer's bytes are)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src = torch.ones(MEMCPY_MB << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - began)
    torch.set_num_threads(threads)
    return src.numel() * 4 / best / 1e9


class RssSampler:
    """Peak RSS of each worker's process tree, from RUN_DIR/workers.json's pids."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self._stop = run_dir, threading.Event()
        self.peak: dict[str, int] = {}
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        workers: dict[str, psutil.Process] = {}
        while not self._stop.wait(0.5):
            if not workers and (self.run_dir / WORKERS).is_file():
                for w in msgspec.json.decode((self.run_dir / WORKERS).read_bytes()):
                    workers[f"{w['role']}-{w['rank']}"] = psutil.Process(w["pid"])
            for name, proc in workers.items():
                total = 0
                try:
                    for p in [proc, *proc.children(recursive=True)]:
                        total += p.memory_info().rss
                except psutil.Error:
                    continue  # exited, or a child did meanwhile
                self.peak[name] = max(self.peak.get(name, 0), total)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {name: rss / 1e9 for name, rss in sorted(self.peak.items())}


def config_for(model: str, steps: int, out_dir: str, compute_dtype: str) -> Config:
    return decode_config({
        "model": {"path": model, "dtype": "float32"},
        "task": {"kind": "arithmetic", "eval_size": 0},
        "rollout": {"num_workers": 1, "group_size": 4, "max_new_tokens": 32,
                    "max_inflight_prompts": 4, "ignore_eos": True, "dtype": "bfloat16",
                    "kv_cache_gib": 2},
        "staleness": {"max_staleness": 1},
        "trainer": {"groups_per_step": 4, "micro_batch_tokens": 1024, "lr": 1e-5,
                    "compute_dtype": compute_dtype},
        "run": {"num_steps": steps, "output_dir": out_dir, "progress": False,
                "checkpoint_every": 2, "keep_checkpoints": 1},
    })


def run(model: Path, steps: int, out_dir: Path, compute_dtype: str) -> Result:
    import torch
    from transformers import AutoModelForCausalLM

    from async_rl.analysis.idle import TRAINER_TRACK
    from async_rl.analysis.report import read_spans
    from async_rl.api import train
    from async_rl.control.checkpoint_files import CHECKPOINTS, TRAINER
    from async_rl.models.real_size import make_random_model
    from workers.trainer.checkpoint_folder import TRAINING_STATE

    if not (model / "config.json").is_file():
        make_random_model(model)
    config = config_for(str(model), steps, str(out_dir), compute_dtype)
    shutil.rmtree(out_dir, ignore_errors=True)  # the sampler must not find an old run's pids
    memcpy = memcpy_gb_per_s()
    sampler = RssSampler(out_dir)
    began = time.perf_counter()
    try:
        train(config)
    finally:
        peak = sampler.stop()
    wall = time.perf_counter() - began
    # What a checkpoint costs the trainer: the training track's `checkpoint` spans (the
    # shard taking its snapshot, and at the end waiting for the last write), by step.
    waited: dict[int, float] = {}
    for span in read_spans(out_dir):
        if span.worker == TRAINER_TRACK and span.cause == "checkpoint":
            waited[span.version] = waited.get(span.version, 0.0) + span.end - span.start

    newest = sorted((out_dir / CHECKPOINTS).glob("step-*"))[-1] / TRAINER
    t0 = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(newest, dtype=torch.float32)
    torch.load(newest / TRAINING_STATE, weights_only=True)
    read_s = time.perf_counter() - t0
    parameters = sum(p.numel() for p in loaded.parameters())
    # What a publish sends: the parameters (tied ones once), in bf16.
    update_bytes = sum(p.numel() * 2 for p in loaded.parameters())
    size = sum(f.stat().st_size for f in newest.iterdir()) / 1e9

    rows = []
    for line in (out_dir / METRICS).read_bytes().splitlines():
        m = msgspec.json.decode(line)
        sent = m["broadcast"]
        step_s = m["wait_s"] + m["train_s"] + m["sync_s"]
        completion = round(m["completion_tokens"]["mean"] * m["groups"]
                           * config.rollout.group_size)
        transfer = sum(b["transfer_s"] for b in sent)
        rows.append(StepRow(
            step=m["step"], completion_tokens=completion, step_s=step_s,
            completion_tok_per_s=completion / step_s if step_s else 0.0,
            train_s=m["train_s"], publish_s=sum(b["publish_s"] for b in sent),
            transfer_s=transfer, load_s=sum(b["load_s"] for b in sent),
            transfer_gb_per_s=len(sent) * update_bytes / transfer / 1e9 if transfer else 0.0,
            checkpoint_s=waited.get(m["step"])))
    return Result(parameters=parameters, update_bytes=update_bytes, memcpy_gb_per_s=memcpy,
                  steps=rows, checkpoint_gb=size, checkpoint_read_s=read_s,
                  peak_rss_gb=peak, wall_s=wall)


def tables(result: Result, console: Console) -> None:
    table = Table(title=f"real-size async GRPO: {result.parameters / 1e6:.0f}M parameters, "
                        f"update {result.update_bytes / 1e9:.2f} GB (bf16), memcpy "
                        f"{result.memcpy_gb_per_s:.1f} GB/s (one thread)")
    for column in ("step", "compl. tokens", "step s", "compl. tok/s", "train s", "publish s",
                   "transfer s", "load s", "GB/s", "x memcpy", "checkpoint s",
                   "x step"):
        table.add_column(column, justify="right")
    for r in result.steps:
        table.add_row(str(r.step), str(r.completion_tokens), f"{r.step_s:.1f}",
                      f"{r.completion_tok_per_s:.0f}", f"{r.train_s:.1f}",
                      f"{r.publish_s:.2f}", f"{r.transfer_s:.2f}", f"{r.load_s:.2f}",
                      f"{r.transfer_gb_per_s:.2f}",
                      f"{r.transfer_gb_per_s / result.memcpy_gb_per_s:.3f}",
                      "-" if r.checkpoint_s is None else f"{r.checkpoint_s:.2f}",
                      "-" if r.checkpoint_s is None else f"{r.checkpoint_s / r.step_s:.3f}")
    console.print(table)
    console.print(f"checkpoint: {result.checkpoint_gb:.2f} GB, read (weights + optimizer "
                  f"state) {result.checkpoint_read_s:.1f}s; peak RSS per worker tree: "
                  + ", ".join(f"{k} {v:.1f} GB" for k, v in result.peak_rss_gb.items())
                  + f"; run wall {result.wall_s:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/model-0.5b")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out-dir", default="runs/bench-real-size")
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="trainer.compute_dtype (the master weights stay float32)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    with stdout_to_stderr(args.json):
        result = run(Path(args.model), args.steps, Path(args.out_dir), args.compute_dtype)
    show(result, args.json, tables)


if __name__ == "__main__":
    main()
