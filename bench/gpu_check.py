"""GPU check: the trainer-side CUDA paths that no GPU had run, on one GPU, in one table.

Runs with only torch, transformers and the wheels ``scripts/gpu-check.sh`` carries
(msgspec, nvidia-ml-py): nothing here imports ray or vllm (checked before anything runs).
Without CUDA it prints one line and exits 0. On CUDA, on a randomly initialised
Qwen2.5-0.5B-shaped model (``async_rl.models.real_size``):

- the attention kernels (``workers.trainer.attention``): the one-call varlen kernel against
  the per-sequence loop on 2.5k and 16k tokens of Qwen2.5-0.5B's heads in bf16
  (outputs, q/k/v gradients, forward + backward time), and on 2.5k as a sliding-window
  layer of 128 tokens (the window handed to flash against the loop's mask);
- packed against padded logprobs on a long-tail batch, float32 and bf16 compute;
- ``TrainerShard`` steps (``bench/trainer_step.py`` builds them), each with ms, tokens/s,
  MFU (6 N per token plus causal attention, against the GPU's dense bf16 peak), host
  syncs per step (``torch.cuda.set_sync_debug_mode``), peak memory and the fraction of
  the step the GPU is busy (profiler kernel time / wall): (a) today's path and (b) the
  new one on the check batch (48 long-tail sequences, 2 micro-batches), the new one in
  float32 compute (TF32), (c) 4 x 16k-token micro-batches eager, (d) the same compiled
  (``trainer.compile``), (e) the same with Qwen's 151,936-token vocabulary, today's path
  and the new one compiled;
- NVML's view of each visible GPU, found by the UUID CUDA reports
  (``workers.usage.cuda_uuid``), beside what an index lookup would have sampled;
- FSDP2 at world size 1: ``fully_shard`` per decoder layer and the root with a pinned
  ``CPUOffloadPolicy`` and bf16 ``MixedPrecisionPolicy``, one AdamW step;
- FSDP2 offload's gradient clip at world size 1 in the group trainer.offload makes
  ("cpu:gloo,cuda:nccl", ``process_group_backend``), beside the same clip over a group
  of NCCL alone, which has no backend for the CPU gradients.

    scripts/gpu-check.sh            (or: PYTHONPATH=. python bench/gpu_check.py)
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import trainer_step
from transformers import Qwen2ForCausalLM

from async_rl.models.real_size import QWEN25_05B, make_random_model, real_size_config
from buffers.records import GroupTokens, SequenceSlot, ShardBatch, TrainSequence
from workers.trainer.packing import pack, packed_logprobs, padded_logprobs
from workers.trainer.process import process_group_backend
from workers.trainer.shard import TrainerShard
from workers.usage import cuda_uuid

FORBIDDEN = ("ray", "vllm")
"""Not on the GPU machine: importing either would fail there."""
PEAK_BF16_TFLOPS = trainer_step.PEAK_BF16_TFLOPS
SEQUENCES = 48
"""Sequences of the long-tail batch: about 5k tokens."""
SEQUENCES_16K = 155
"""Long-tail sequences in about 16k tokens."""
MICRO_BATCHES_16K = 4

Row = tuple[str, str, str]
"""(check, result, figures)."""


def long_tail(n: int = SEQUENCES, seed: int = 0, vocab: int = 259) -> list[TrainSequence]:
    """Prompts of 20-40 tokens, completions of 20-300 (a long tail: most are short),
    token ids in 3..``vocab``."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt, completion = int(rng.integers(20, 41)), int(min(300, 20 + rng.pareto(1.2) * 30))
        ids = rng.integers(3, vocab, prompt + completion).astype(np.int32)
        out.append(TrainSequence(prompt_token_ids=ids[:prompt], completion_token_ids=ids[prompt:],
                                 behaviour_logprobs=-rng.random(completion).astype(np.float32),
                                 advantage=float(i % 2) - 0.5))
    return out


def shard_batch(seqs: list[TrainSequence], micro_batches: int = 2
                ) -> tuple[ShardBatch, list[GroupTokens]]:
    """``seqs`` as one update of ``micro_batches`` micro-batches of single-sample groups."""
    tokens = [GroupTokens(prompt_token_ids=s.prompt_token_ids,
                          completion_token_ids=s.completion_token_ids,
                          logprobs=s.behaviour_logprobs,
                          versions=np.zeros(len(s.completion_token_ids), np.int32),
                          offsets=np.array([0, len(s.completion_token_ids)], np.int64))
              for s in seqs]
    slots = [SequenceSlot(group=i, sample=0, advantage=s.advantage) for i, s in enumerate(seqs)]
    cut = math.ceil(len(slots) / micro_batches)
    rows = tuple(tuple(slots[i:i + cut]) for i in range(0, len(slots), cut))
    return ShardBatch(step=1, groups=tuple(tokens), micro_batches=rows,
                      updates=(len(rows),)), tokens


def timed_step(shard: TrainerShard, batch: ShardBatch, tokens: list[GroupTokens],
               repeats: int = 3) -> tuple[float, float]:
    """(median step seconds after one warm-up step, seconds of that first step)."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    shard.train_step(batch, tokens)
    torch.cuda.synchronize()
    first = time.perf_counter() - began
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        result = shard.train_step(batch, tokens)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    if not math.isfinite(result.grad_norm):
        raise FloatingPointError("non-finite gradient norm")
    return statistics.median(times), first


def step_row(label: str, shard: TrainerShard, batch: ShardBatch, tokens: list[GroupTokens],
             peak_tflops: float | None) -> Row:
    """One ``TrainerShard`` step measured: ms, tokens/s, MFU, syncs, peak memory, busy."""
    step_s, first_s = timed_step(shard, batch, tokens)
    real = sum(len(t.prompt_token_ids) + len(t.completion_token_ids) for t in tokens)
    flops = trainer_step.model_flops(batch, tokens, shard.module)
    mfu = f"MFU {flops / step_s / (peak_tflops * 1e12):.1%}, " if peak_tflops else ""
    syncs = trainer_step.count_syncs(lambda: shard.train_step(batch, tokens))
    peak = trainer_step.cuda_peak_mib(shard, batch, tokens)
    busy = trainer_step.busy_fraction(lambda: shard.train_step(batch, tokens))
    return (label, "ok", f"{step_s * 1e3:.0f} ms (first {first_s:.1f} s), {real / step_s:,.0f} "
            f"tokens/s, {mfu}{syncs} syncs/step, peak {peak / 1024:.2f} GiB, GPU busy "
            f"{busy:.0%}; {len(batch.micro_batches)} micro-batches, {real:,} tokens")


def attention_row(total: int, device: torch.device, window: int | None = None) -> Row:
    """The varlen kernel against the per-sequence loop on ``total`` long-tail tokens of
    Qwen2.5-0.5B's heads (bf16): outputs, q/k/v gradients, forward + backward time;
    ``window``: as a sliding-window layer of that many tokens."""
    from workers.trainer import attention

    kernel = attention.varlen_kernel(device, torch.bfloat16, windowed=window is not None)
    name = attention.kernel_name(kernel)
    c = QWEN25_05B
    head_dim = c.hidden_size // c.num_heads
    lengths, rng = [], np.random.default_rng(total)
    while sum(lengths) < total:
        lengths.append(int(min(340, 40 + rng.pareto(1.2) * 30)))
    lengths[-1] -= sum(lengths) - total
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                      device=device)
    kwargs = attention.attention_kwargs(cu, max(lengths), tuple(lengths))
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, total, head_dim, device=device, dtype=torch.bfloat16,
                           generator=gen).requires_grad_()
               for heads in (c.num_heads, c.num_kv_heads, c.num_kv_heads))
    upstream = torch.randn(1, total, c.num_heads, head_dim, device=device,
                           dtype=torch.bfloat16, generator=gen)
    module = torch.nn.Module().eval()
    ways = {"varlen": lambda: attention.packed_attention(module, q, k, v, None,
                                                         sliding_window=window, **kwargs)[0],
            "loop": lambda: attention.per_sequence_attention(q, k, v, lengths, 0.0, None,
                                                             window).transpose(1, 2)}
    results, times = [], []
    for run in ways.values():
        out = run()
        results.append((out, *torch.autograd.grad((out.float() * upstream).sum(), (q, k, v))))
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(5):
            torch.autograd.grad((run().float() * upstream).sum(), (q, k, v))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) / 5 * 1e3)
    # bf16 outputs, gradients summed over many queries: relative to each tensor's largest.
    diff = max(float((a.detach().float() - b.detach().float()).abs().max()
                     / b.detach().float().abs().max().clamp(min=1e-6))
               for a, b in zip(results[0], results[1], strict=True))
    windowed = f", window {window}" if window is not None else ""
    return (f"varlen attention = loop ({total} tokens{windowed})",
            "ok" if diff <= 0.05 else "MISMATCH",
            f"{name}: max |diff| / max |loop| of output and q/k/v grads {diff:.1e}; fwd+bwd "
            f"{times[0]:.2f} ms vs loop {times[1]:.2f} ms over {len(lengths)} sequences")


def trainer_checks(root: Path) -> list[Row]:
    model_dir = root / "model-0.5b"
    make_random_model(model_dir, log=None)
    rows: list[Row] = []
    seqs = long_tail()
    batch, tokens = shard_batch(seqs)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    for dtype in ("float32", "bfloat16"):
        packed = trainer_step.make_shard(model_dir, "new", 16384, dtype, compile=False)
        padded = trainer_step.make_shard(model_dir, "trl", 16384, dtype)
        with torch.no_grad(), packed.losses.autocast():
            a = packed_logprobs(packed.module, pack(seqs, packed.device), 1.0)
            b, _ = padded_logprobs(padded.module, seqs, 1.0, padded.device)
        diff = float((a - b).abs().max())
        tolerance = 1e-3 if dtype == "float32" else 0.1
        rows.append((f"packed = padded logprobs ({dtype})",
                     "ok" if diff <= tolerance else "MISMATCH",
                     f"max |diff| {diff:.2e} (tolerance {tolerance:g}), {a.numel()} tokens"))
        del padded
        if dtype == "float32":  # TF32 matmuls, the attention loop: bf16 is the GPU setup
            rows.append(step_row("(b') new path, float32 compute", packed, batch, tokens, None))
        del packed
        torch.cuda.empty_cache()
    for label, way, compiled in (("(a) today's path", "today", False),
                                 ("(b) new path", "new", False)):
        shard = trainer_step.make_shard(model_dir, way, 16384, "bfloat16", compile=compiled)
        rows.append(step_row(f"{label}, check batch", shard, batch, tokens, peak))
        del shard
        torch.cuda.empty_cache()
    big, big_tokens = shard_batch(long_tail(MICRO_BATCHES_16K * SEQUENCES_16K, seed=1),
                                  MICRO_BATCHES_16K)
    for label, compiled in (("(c) 4 x 16k eager", False), ("(d) 4 x 16k compiled", True)):
        shard = trainer_step.make_shard(model_dir, "new", 1 << 17, "bfloat16",
                                        compile=compiled)
        rows.append(step_row(label, shard, big, big_tokens, peak))
        del shard
        torch.cuda.empty_cache()
    wide_dir = root / "model-0.5b-vocab"
    config = real_size_config(QWEN25_05B)
    config.vocab_size = trainer_step.QWEN_VOCAB
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(wide_dir)
    wide, wide_tokens = shard_batch(
        long_tail(MICRO_BATCHES_16K * SEQUENCES_16K, seed=1, vocab=trainer_step.QWEN_VOCAB),
        MICRO_BATCHES_16K)
    for label, way in (("(e) 151,936 vocab, today's path", "today"),
                       ("(e) 151,936 vocab, new path compiled", "new")):
        shard = trainer_step.make_shard(wide_dir, way, 1 << 17, "bfloat16",
                                        compile=way == "new")
        rows.append(step_row(label, shard, wide, wide_tokens, peak))
        del shard
        torch.cuda.empty_cache()
    return rows


def nvml_check() -> list[Row]:
    try:
        import pynvml
    except ImportError:
        return [("NVML by UUID", "skipped", "no pynvml (nvidia-ml-py)")]
    pynvml.nvmlInit()
    rows = []
    for ordinal in range(torch.cuda.device_count()):
        uuid = cuda_uuid(ordinal)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        index = pynvml.nvmlDeviceGetIndex(handle)
        by_index = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(ordinal))
        same = "same device" if by_index == uuid else f"index {ordinal} is another GPU"
        util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        rows.append((f"NVML by UUID (cuda:{ordinal})", "ok" if
                     pynvml.nvmlDeviceGetUUID(handle) == uuid else "MISMATCH",
                     f"{uuid} = NVML index {index}; NVML index {ordinal}: {same}; "
                     f"util {util}%; CUDA_VISIBLE_DEVICES="
                     f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}"))
    pynvml.nvmlShutdown()
    return rows


def fsdp2_check(model_dir: Path) -> list[Row]:
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        policy: dict[str, Any] = dict(
            offload_policy=CPUOffloadPolicy(pin_memory=True),
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.float32))
        for layer in model.model.layers:
            fully_shard(layer, **policy)
        fully_shard(model, **policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(3, 259, (4, 512), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - began) / 2
        local = next(iter(model.parameters())).to_local()
        where = f"{local.device}, pinned {local.is_pinned()}"
        return [("FSDP2 + pinned CPUOffloadPolicy (1 rank)",
                 "ok" if math.isfinite(float(loss)) else "NON-FINITE",
                 f"{step_s * 1e3:.0f} ms/step (4 x 512), loss {float(loss):.3f}, shards on "
                 f"{where}, GPU peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")]
    finally:
        dist.destroy_process_group()


def offload_clip_check(device: torch.device, accelerator_backend: str = "nccl",
                       port: int = 29513) -> list[Row]:
    """A small FSDP2 model's CPU-offloaded gradients clipped in the group trainer.offload
    makes, which all-reduces a CPU tensor too; beside it the same all-reduce in a group
    of the accelerator's backend alone (CUDA's group before), which must fail. One rank
    cannot show the clip itself failing (its norm needs no collective); two processes
    on CPU do (tests/unit/test_offload_process_group.py). ``device``: where the model
    computes; ``accelerator_backend``: the backend registered for cuda (gloo lets a
    CPU-only machine build the same groups)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    def mlp() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                   torch.nn.Linear(256, 8)).to(device)

    def all_reduce_on_cpu(group: Any = None) -> str:
        total = torch.ones(1)
        try:
            dist.all_reduce(total, group=group)
        except RuntimeError as err:
            return f"fails ({str(err).splitlines()[0][:60]})"
        return f"sums {float(total):g}"

    inputs = torch.linspace(-1, 1, 4 * 64, device=device).reshape(4, 64)
    reference = mlp()
    reference(inputs).square().sum().backward()
    expected = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3))
    backend = process_group_backend(torch.device("cuda"), offload=True,
                                    accelerator_backend=accelerator_backend)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        alone = all_reduce_on_cpu(dist.new_group(backend=f"cuda:{accelerator_backend}"))
        joint = all_reduce_on_cpu()
        model = mlp()
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        mesh = init_device_mesh(device.type, (1,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh, offload_policy=offload)
        fully_shard(model, mesh=mesh, offload_policy=offload)
        model(inputs).square().sum().backward()
        where = {str(p.grad.to_local().device) for p in model.parameters()  # type: ignore[union-attr]
                 if p.grad is not None}
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
    finally:
        dist.destroy_process_group()
    good = (math.isclose(norm, expected, rel_tol=1e-4) and where == {"cpu"}
            and alone.startswith("fails") and joint == "sums 1")
    return [(f"FSDP2 offload clip ({backend}, 1 rank)", "ok" if good else "MISMATCH",
             f"grad norm {norm:.4g} (unsharded {expected:.4g}), grads on "
             f"{', '.join(sorted(where))}; CPU all-reduce: {joint}, with "
             f"{accelerator_backend} alone {alone}")]


def run_check(name: str, check: Callable[[], list[Row]]) -> list[Row]:
    """A check's rows, or one row saying how it failed (the others still run)."""
    try:
        return check()
    except Exception as err:  # reported in the table, not raised: one bad path is a row
        return [(name, "FAILED", f"{type(err).__name__}: {str(err).splitlines()[0][:150]}")]


def table(rows: list[Row]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n".join(f"{a.ljust(widths[0])}  {b.ljust(widths[1])}  {c}" for a, b, c in rows)


def main() -> int:
    leaked = [m for m in FORBIDDEN if m in sys.modules]
    if leaked:
        print(f"gpu check error: importing the trainer pulled in {', '.join(leaked)}")
        return 1
    if not torch.cuda.is_available():
        print(f"gpu check skipped: no CUDA device (torch {torch.__version__}; imports "
              f"checked, no {' or '.join(FORBIDDEN)})")
        return 0
    began = time.perf_counter()
    rows: list[Row] = [("check", "result", "figures"),
                       ("device", torch.cuda.get_device_name(),
                        f"torch {torch.__version__}, CUDA {torch.version.cuda}, msgspec "
                        f"{msgspec.__version__}")]
    with tempfile.TemporaryDirectory(prefix="async-rl-gpu-check-") as root:
        rows += run_check("attention kernels", lambda: [
            *(attention_row(total, torch.device("cuda")) for total in (2500, 16384)),
            attention_row(2500, torch.device("cuda"), window=128)])  # gpt-oss's window
        rows += run_check("TrainerShard", lambda: trainer_checks(Path(root)))
        model_dir = Path(root) / "model-0.5b"
        rows += run_check("NVML by UUID", nvml_check)
        rows += run_check("FSDP2 + pinned CPUOffloadPolicy", lambda: fsdp2_check(model_dir))
        rows += run_check("FSDP2 offload clip",
                          lambda: offload_clip_check(torch.device("cuda")))
    rows.append(("total", "", f"{time.perf_counter() - began:.0f} s"))
    print(table(rows))
    return 0 if all(r[1] not in ("FAILED", "MISMATCH", "NON-FINITE") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
