"""Benchmark: one trainer step three ways, side by side in one process.

On two fixed batches (``--repeats`` timed steps each, the ways alternating A B C A B C
after one warm-up step each, medians):

- ``long-tail``: ``--sequences`` sequences of the long-tail task's lengths
  (``async_rl.tasks.synthetic.long_tail_groups``: prompts about 6 tokens, completions
  median about 20, 99th percentile about 210) on the ``small`` model (vocabulary 264),
  planned into micro-batches of at most ``--cap`` tokens as a run plans them;
- ``vocab-151936``: ``--vocab-sequences`` sequences of the same lengths with token ids
  drawn from Qwen's 151,936-token vocabulary, on a small Qwen2-shaped model built here
  with that vocabulary (hidden 128, 2 layers, tied embeddings; nothing downloaded).

The three ways, each a ``TrainerShard`` step (forward, backward, AdamW) over the same
micro-batches:

- ``new``: the trainer as it is (offsets once on the host, attention from them, the
  fused chunked LM head with log-prob and entropy, statistics read once a step);
- ``today``: the trainer before it (a faithful reimplementation of its micro-batch:
  each layer's attention recovers the sequence lengths from the position ids with
  ``nonzero`` and ``tolist``, the LM head builds the ``(N, V)`` logits of the
  completion tokens, log-probs and entropy are computed from them, the statistics are
  read after every micro-batch, and on CUDA the device is synchronised at each phase);
- ``trl``: the way TRL computes the same loss: one right-padded row per sequence, an
  attention mask, the logits of every position (``packed = false``).

Figures per way: tokens/s (real tokens / step), and the peak memory of a step: on CUDA
``torch.cuda.max_memory_allocated`` above the memory before the step; on the CPU the
peak resident set of a fresh subprocess running one step, above its resident set
before the step (``/proc/self/clear_refs`` resets the high-water mark, ``VmHWM`` reads
it; no tracemalloc, which sees no torch allocations). Either way the first step's
AdamW state counts in every way alike. TRL's way holds the logits of every position:
at the 151,936 vocabulary 16 sequences already take about 8 GB on the CPU, hence the
small default of ``--vocab-sequences``. On CUDA also the MFU (6 x
parameters x tokens plus causal attention, against the GPU's dense bf16 peak), host
synchronisations per step (``torch.cuda.set_sync_debug_mode``) and the fraction of the
step the GPU is busy (profiler kernel time / wall time).

Imports no ray, vllm or rich: ``bench/gpu_check.py`` runs it on a GPU machine that has
only torch and transformers.

    python -m bench.trainer.trainer_step [--repeats 2] [--cap 2048] [--json]

Its last line: ``trainer_step: packed/padded tokens/s R1, peak memory new/today R2``
(R1: the new path's tokens/s over TRL's padded way on the long-tail batch; R2: the new
path's peak memory over today's at the 151,936 vocabulary).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from async_rl.models.tiny_model import MODEL_SIZES, build_config, size_config
from async_rl.tasks.synthetic import long_tail_groups
from buffers.common.records import Group, GroupTokens
from buffers.common.train_records import ShardBatch
from buffers.plan.batching import shard_batches
from workers.model_config import ModelConfig
from workers.trainer.config import TrainerConfig
from workers.trainer.loss import Normaliser, PendingStats, read_stats
from workers.trainer.packing import completion_logprobs, pack, token_entropy
from workers.trainer.ppo_update import ForwardPass, Prepared, StepLoss
from workers.trainer.shard import TrainerShard
from workers.trainer.spec import TrainerSpec

WAYS = ("new", "today", "trl")
QWEN_VOCAB = 151_936
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}
"""Dense bf16 tensor-core peaks by device name (no sparsity)."""
TODAY_ATTENTION = "async_rl_today_sdpa"


class WayFigures(msgspec.Struct, frozen=True, kw_only=True):
    way: str
    step_ms: float
    tokens_per_s: float
    peak_mib: float
    """Peak memory of one step above the memory before it (see the module docstring)."""
    mfu: float | None = None
    syncs: int | None = None
    busy: float | None = None


class BatchFigures(msgspec.Struct, frozen=True, kw_only=True):
    batch: str
    vocab: int
    sequences: int
    tokens: int
    micro_batches: int
    ways: list[WayFigures]


# -- today's micro-batch, reimplemented -------------------------------------------------


def _segment_lengths(positions: torch.Tensor) -> list[int]:
    """Today's per-layer read: a new sequence starts where the position is 0."""
    starts = torch.nonzero(positions == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return [b - a for a, b in zip(starts, [*starts[1:], positions.numel()], strict=True)]


def today_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                    dropout: float = 0.0, scaling: float | None = None,
                    position_ids: torch.Tensor | None = None, **_: Any
                    ) -> tuple[torch.Tensor, None]:
    """Today's attention: lengths read from the position ids in every layer, causal
    SDPA per sequence (q, k and v left in the dtypes they come in)."""
    gqa = key.shape[1] != query.shape[1]
    rows = []
    for b in range(query.shape[0]):
        lengths = ([query.shape[2]] if position_ids is None
                   else _segment_lengths(position_ids[min(b, position_ids.shape[0] - 1)]))
        parts = [torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            for q, k, v in zip(query[b:b + 1].split(lengths, 2), key[b:b + 1].split(lengths, 2),
                               value[b:b + 1].split(lengths, 2), strict=True)]
        rows.append(torch.cat(parts, 2))
    return torch.cat(rows, 0).transpose(1, 2).contiguous(), None


class TodayStepLoss(StepLoss):
    """``StepLoss`` with today's micro-batch: packed again at every forward, the full
    ``(N, V)`` logits, statistics read after every micro-batch, a sync per phase on CUDA."""

    def forward(self, model: torch.nn.Module, micro_batch: Prepared, *,
                router_aux: bool = False) -> ForwardPass:
        del router_aux  # a dense benchmark model: trainer.router_aux_coef stays 0
        batch = pack(micro_batch.sequences, self.device)
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                       use_cache=False, logits_to_keep=batch.predict_at).logits[0]
        return ForwardPass(logprobs=completion_logprobs(logits, batch.targets, self.temperature),
                           entropy=token_entropy(logits, self.temperature),
                           behaviour=batch.behaviour_logprobs, advantages=batch.advantages,
                           positions=batch.num_tokens)

    def micro_batch(self, micro_batch: Prepared, norm: Normaliser,
                    proximal: torch.Tensor | None = None,
                    reference: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, PendingStats | None, int]:
        loss, stats, positions = super().micro_batch(micro_batch, norm, proximal, reference)
        if stats is not None:
            read_stats([stats])  # today: the statistics' floats read per micro-batch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # today: a sync at each phase boundary
        return loss, stats, positions


def make_shard(model_dir: Path, way: str, cap: int, compute_dtype: str = "float32",
               **trainer: Any) -> TrainerShard:
    """A set-up single shard stepping ``way``; TRL's way, the reference, is never
    compiled (whatever ``trainer`` says): only its values count, and its padded rows
    would compile again for every batch shape."""
    if way == "trl":
        trainer = {**trainer, "compile": False}
    config = msgspec.convert({"micro_batch_tokens": cap, "packed": way != "trl",
                              "compute_dtype": compute_dtype, "max_grad_norm": 1e9,
                              **trainer}, TrainerConfig)
    shard = TrainerShard(TrainerSpec(
        rank=0, world_size=1, model=ModelConfig(path=str(model_dir)), trainer=config, seed=0,
        record_spans=False))
    shard.setup()
    if way == "today":
        from transformers import AttentionInterface

        AttentionInterface.register(TODAY_ATTENTION, today_attention)
        shard.module.set_attn_implementation(TODAY_ATTENTION)  # type: ignore[operator]
        old = shard.losses
        shard.losses = TodayStepLoss(
            config=old.config, model=old.model, module=old.module, device=old.device,
            world_size=old.world_size, packed=True, temperature=old.temperature,
            max_response_tokens=old.max_response_tokens, sharded=old.sharded)
    return shard


# -- batches and models -----------------------------------------------------------------


def with_vocab(groups: Sequence[Group], vocab: int, seed: int = 0) -> list[Group]:
    """The groups with every token id redrawn from ``vocab`` (same lengths)."""
    rng = np.random.default_rng(seed)

    def redraw(ids: np.ndarray) -> np.ndarray:
        return rng.integers(3, vocab, len(ids)).astype(ids.dtype)

    return [msgspec.structs.replace(g, tokens=msgspec.structs.replace(
        g.tokens, prompt_token_ids=redraw(g.tokens.prompt_token_ids),
        completion_token_ids=redraw(g.tokens.completion_token_ids))) for g in groups]


def plan(groups: Sequence[Group], cap: int) -> tuple[ShardBatch, list[GroupTokens]]:
    """The groups planned into one shard's micro-batches of at most ``cap`` tokens."""
    (batch,), _ = shard_batches(list(groups), 1, TrainerConfig(micro_batch_tokens=cap),
                                step=1)
    return batch, list(batch.groups)  # in-process: the groups hold their own tokens


def save_model(out: Path, vocab: int, size: str = "small") -> Path:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = size_config(MODEL_SIZES[size]) if vocab <= 264 else build_config()
    config.vocab_size = vocab
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


BATCHES = ("long-tail", f"vocab-{QWEN_VOCAB}")


def groups_of(name: str, args: argparse.Namespace) -> list[Group]:
    """The fixed batch ``name`` (the same every call)."""
    if name == "long-tail":
        return long_tail_groups(args.sequences, seed=0)
    return with_vocab(long_tail_groups(args.vocab_sequences, seed=1), QWEN_VOCAB)


def model_of(name: str, root: Path) -> Path:
    """``name``'s model, written under ``root``."""
    return save_model(root / name, 264 if name == "long-tail" else QWEN_VOCAB)


# -- measuring --------------------------------------------------------------------------


def model_flops(batch: ShardBatch, tokens: Sequence[GroupTokens], module: torch.nn.Module
                ) -> float:
    """Training FLOPs of one pass: 6 x parameters per token, plus causal attention
    (6 x layers x hidden per token pair of each sequence, half the square)."""
    config = module.config  # type: ignore[attr-defined]
    params = sum(p.numel() for p in module.parameters())
    lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids)
               for mb in batch.sequences(tokens) for s in mb]
    return 6.0 * params * sum(lengths) + 3.0 * config.num_hidden_layers * \
        config.hidden_size * sum(n * n for n in lengths)


def count_syncs(fn: Callable[[], Any]) -> int:
    """Host synchronisations ``fn`` makes on CUDA (each a sync-debug warning)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def busy_fraction(fn: Callable[[], Any]) -> float:
    """GPU kernel time / wall time of ``fn`` (kernels can overlap: at most about 1)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    kernel_us = sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA")
    return kernel_us / 1e6 / wall


def cpu_peak_mib(name: str, model_dir: Path, way: str, args: argparse.Namespace) -> float:
    """A fresh process's peak resident set over one step of ``way`` on batch ``name``,
    above its resident set before the step, in MiB."""
    done = subprocess.run(
        [sys.executable, __file__, "--peak-of", way, "--batch", name, "--model",
         str(model_dir), "--cap", str(args.cap), "--sequences", str(args.sequences),
         "--vocab-sequences", str(args.vocab_sequences)],
        capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_of_one_step(args: argparse.Namespace) -> float:
    """(In the subprocess) one step's peak resident set above the one before, MiB."""
    torch.set_num_threads(1)
    shard = make_shard(args.model, args.peak_of, args.cap)
    batch, tokens = plan(groups_of(args.batch, args), args.cap)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    shard.train_step(batch, tokens)
    return (_status_kib("VmHWM") - before) / 1024


def measure(shards: dict[str, TrainerShard], batch: ShardBatch, tokens: list[GroupTokens],
            repeats: int, peaks: dict[str, float]) -> list[WayFigures]:
    """Times every way's step, alternating, after one warm-up step each."""
    cuda = torch.cuda.is_available()
    for shard in shards.values():
        shard.train_step(batch, tokens)
    times: dict[str, list[float]] = {way: [] for way in shards}
    real = 0
    for _ in range(repeats):
        for way, shard in shards.items():
            if cuda:
                torch.cuda.synchronize()
            began = time.perf_counter()
            real = shard.train_step(batch, tokens).input_tokens
            if cuda:
                torch.cuda.synchronize()
            times[way].append(time.perf_counter() - began)
    out = []
    for way, shard in shards.items():
        step_s = statistics.median(times[way])
        extra: dict[str, Any] = {}
        if cuda:
            name = torch.cuda.get_device_name()
            peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
            if peak:
                extra["mfu"] = model_flops(batch, tokens, shard.module) / step_s / (peak * 1e12)
            extra["syncs"] = count_syncs(lambda s=shard: s.train_step(batch, tokens))
            extra["busy"] = busy_fraction(lambda s=shard: s.train_step(batch, tokens))
        out.append(WayFigures(way=way, step_ms=step_s * 1e3, tokens_per_s=real / step_s,
                              peak_mib=peaks[way], **extra))
    return out


def cuda_peak_mib(shard: TrainerShard, batch: ShardBatch, tokens: list[GroupTokens]) -> float:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    shard.train_step(batch, tokens)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def run(args: argparse.Namespace) -> list[BatchFigures]:
    torch.set_num_threads(args.threads)
    out = []
    with tempfile.TemporaryDirectory(prefix="async-rl-trainer-step-") as root:
        for name in BATCHES:
            model_dir = model_of(name, Path(root))
            batch, tokens = plan(groups_of(name, args), args.cap)
            shards = {way: make_shard(model_dir, way, args.cap) for way in WAYS}
            if torch.cuda.is_available():
                peaks = {way: cuda_peak_mib(s, batch, tokens) for way, s in shards.items()}
            else:
                peaks = {way: cpu_peak_mib(name, model_dir, way, args) for way in WAYS}
            ways = measure(shards, batch, tokens, args.repeats, peaks)
            out.append(BatchFigures(
                batch=name, vocab=int(shards["new"].module.config.vocab_size),  # type: ignore[union-attr]
                sequences=sum(len(mb) for mb in batch.micro_batches),
                tokens=sum(len(t.prompt_token_ids) + len(t.completion_token_ids)
                           for t in tokens), micro_batches=len(batch.micro_batches),
                ways=ways))
            del shards
    return out


def ratios(figures: list[BatchFigures]) -> tuple[float, float]:
    """(new / trl tokens/s on the long-tail batch, new / today peak memory at the wide
    vocabulary)."""
    by = {(b.batch, w.way): w for b in figures for w in b.ways}
    wide = f"vocab-{QWEN_VOCAB}"
    return (by["long-tail", "new"].tokens_per_s / by["long-tail", "trl"].tokens_per_s,
            by[wide, "new"].peak_mib / by[wide, "today"].peak_mib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object, then the line")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per way")
    parser.add_argument("--cap", type=int, default=2048, help="micro-batch token cap")
    parser.add_argument("--sequences", type=int, default=128, help="long-tail batch")
    parser.add_argument("--vocab-sequences", type=int, default=16,
                        help="sequences of the 151,936-vocabulary batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--peak-of", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--batch", choices=BATCHES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_of:
        print(peak_of_one_step(args))
        return
    figures = run(args)
    speed, memory = ratios(figures)
    if args.json:
        print(json.dumps(msgspec.to_builtins(figures)))
    else:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else \
            f"CPU, {args.threads} thread(s)"
        print(f"trainer step, {device}, micro-batches <= {args.cap} tokens, "
              f"median of {args.repeats}")
        print(f"{'batch':<14} {'way':<6} {'ms':>8} {'tokens/s':>10} {'peak MiB':>9} "
              f"{'MFU':>6} {'syncs':>6} {'busy':>5}")
        for b in figures:
            for w in b.ways:
                mfu = f"{w.mfu:.1%}" if w.mfu is not None else "-"
                busy = f"{w.busy:.0%}" if w.busy is not None else "-"
                syncs = str(w.syncs) if w.syncs is not None else "-"
                print(f"{b.batch:<14} {w.way:<6} {w.step_ms:>8.0f} {w.tokens_per_s:>10,.0f} "
                      f"{w.peak_mib:>9.0f} {mfu:>6} {syncs:>6} {busy:>5}")
            print(f"  ({b.sequences} sequences, {b.tokens} tokens, {b.micro_batches} "
                  f"micro-batches, vocabulary {b.vocab})")
    print(f"trainer_step: packed/padded tokens/s {speed:.2f}, peak memory new/today "
          f"{memory:.2f}")


if __name__ == "__main__":
    main()
