"""The GPU check's rows (``bench/trainer/gpu_check.py`` runs them, each guarded on its own).

Owns: how large the check runs (``Scale``; ``GPU`` is the real one), what the rows share
(``Setup``: the device, the models written when first needed, the ports) and each row:
the attention kernels against the per-sequence loop, packed against padded logprobs,
``TrainerShard`` steps measured (``bench/trainer/trainer_step.py`` builds them), NVML by UUID,
FSDP2 with pinned offload, FSDP2 offload's gradient clip. Every CUDA call is a plain
``torch.cuda`` one, so that a dry run on the CPU can stub them
(tests/unit/test_gpu_check.py). Imports no ray or vllm.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from async_rl.models.real_size import QWEN25_05B, make_random_model, real_size_config
from async_rl.models.tiny_model import ModelSize
from bench.trainer import trainer_step
from buffers.common.records import GroupTokens, TrainSequence
from buffers.common.train_records import SequenceSlot, ShardBatch
from workers.common.usage import cuda_uuid
from workers.trainer.packing import pack, packed_logprobs, padded_logprobs
from workers.trainer.process import process_group_backend
from workers.trainer.shard import TrainerShard

PEAK_BF16_TFLOPS = trainer_step.PEAK_BF16_TFLOPS
Row = tuple[str, str, str]
"""(check, result, figures)."""


class Scale(NamedTuple):
    """How large the check runs."""

    model: ModelSize
    sequences: int
    """Sequences of the check batch (long-tail lengths, 2 micro-batches)."""
    long_sequences: int
    """Sequences of the long batch, over ``long_micro_batches`` micro-batches."""
    long_micro_batches: int
    attention_tokens: tuple[int, ...]
    """Tokens of each attention row."""
    wide_vocab: int
    """Vocabulary of the (e) rows' model."""
    repeats: int
    """Timed steps of a step row, after one warm-up step."""
    fsdp_batch: tuple[int, int]
    """(rows, tokens) of the FSDP2 row's batch."""


GPU = Scale(model=QWEN25_05B, sequences=48, long_sequences=4 * 155, long_micro_batches=4,
            attention_tokens=(2500, 16384), wide_vocab=trainer_step.QWEN_VOCAB, repeats=3,
            fsdp_batch=(4, 512))
"""The check on a GPU: about 5k tokens in the check batch, 4 x 16k in the long one."""
LONG_CAP = 1 << 17
"""Micro-batch cap of the long rows: their micro-batches are cut by ``shard_batch``."""


def long_tail(n: int, seed: int = 0, vocab: int = 259) -> list[TrainSequence]:
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


class Setup:
    """What the checks share: the device, the scale, a folder for the models (each
    written when a check first needs it, so a failure to write one fails only the rows
    that need it) and the ports of the process groups."""

    def __init__(self, root: Path, device: torch.device, scale: Scale = GPU,
                 port: int = 29512) -> None:
        self.root, self.device, self.scale, self.port = root, device, scale, port

    @functools.cached_property
    def model_dir(self) -> Path:
        out = self.root / f"model-{self.scale.model.name}"
        make_random_model(out, size=self.scale.model, log=None)
        return out

    @functools.cached_property
    def wide_dir(self) -> Path:
        from transformers import Qwen2ForCausalLM

        out = self.root / f"model-{self.scale.model.name}-vocab"
        config = real_size_config(self.scale.model)
        config.vocab_size = self.scale.wide_vocab
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(out)
        return out

    @functools.cached_property
    def peak_tflops(self) -> float | None:
        name = torch.cuda.get_device_name()
        return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)

    def batch(self, which: str) -> tuple[ShardBatch, list[GroupTokens]]:
        """``check``: the check batch; ``long``: the long one; ``wide``: the long one's
        lengths at the wide vocabulary."""
        s = self.scale
        if which == "check":
            return shard_batch(long_tail(s.sequences))
        vocab = s.wide_vocab if which == "wide" else 259
        return shard_batch(long_tail(s.long_sequences, seed=1, vocab=vocab),
                           s.long_micro_batches)


def timed_step(shard: TrainerShard, batch: ShardBatch, tokens: list[GroupTokens],
               repeats: int) -> tuple[float, float]:
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


def step_row(label: str, setup: Setup, way: str, compute_dtype: str, batch_name: str,
             compiled: bool) -> Row:
    """One ``TrainerShard`` step of ``way`` measured: ms, tokens/s, MFU, syncs, peak
    memory, busy."""
    model_dir = setup.wide_dir if batch_name == "wide" else setup.model_dir
    cap = 16384 if batch_name == "check" else LONG_CAP
    batch, tokens = setup.batch(batch_name)
    shard = trainer_step.make_shard(model_dir, way, cap, compute_dtype, compile=compiled)
    try:
        step_s, first_s = timed_step(shard, batch, tokens, setup.scale.repeats)
        real = sum(len(t.prompt_token_ids) + len(t.completion_token_ids) for t in tokens)
        flops = trainer_step.model_flops(batch, tokens, shard.module)
        peak_tflops = setup.peak_tflops
        mfu = f"MFU {flops / step_s / (peak_tflops * 1e12):.1%}, " if peak_tflops else ""
        syncs = trainer_step.count_syncs(lambda: shard.train_step(batch, tokens))
        peak = trainer_step.cuda_peak_mib(shard, batch, tokens)
        busy = trainer_step.busy_fraction(lambda: shard.train_step(batch, tokens))
    finally:
        shard.shutdown()
    return (label, "ok", f"{step_s * 1e3:.0f} ms (first {first_s:.1f} s), "
            f"{real / step_s:,.0f} tokens/s, {mfu}{syncs} syncs/step, peak "
            f"{peak / 1024:.2f} GiB, GPU busy {busy:.0%}; {len(batch.micro_batches)} "
            f"micro-batches, {real:,} tokens")


def attention_row(total: int, setup: Setup, window: int | None = None) -> Row:
    """The varlen kernel against the per-sequence loop on ``total`` long-tail tokens of
    the model's heads (bf16): outputs, q/k/v gradients, forward + backward time;
    ``window``: as a sliding-window layer of that many tokens."""
    from workers.trainer import attention

    device, c = setup.device, setup.scale.model
    kernel = attention.varlen_kernel(device, torch.bfloat16, windowed=window is not None)
    name = attention.kernel_name(kernel, gqa=c.num_kv_heads != c.num_heads)
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


@contextlib.contextmanager
def tf32_off() -> Iterator[None]:
    """float32 matmuls in full precision for a while (``speed_up`` switched TF32 on for
    the process)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def logprob_row(setup: Setup, dtype: str) -> Row:
    """Packed logprobs against the padded reference's (never compiled) on the check
    batch's sequences."""
    seqs = long_tail(setup.scale.sequences)
    packed = trainer_step.make_shard(setup.model_dir, "new", 16384, dtype, compile=False)
    padded = trainer_step.make_shard(setup.model_dir, "trl", 16384, dtype)
    exact = tf32_off() if dtype == "float32" else contextlib.nullcontext()
    try:
        with torch.no_grad(), packed.losses.autocast(), exact:
            a = packed_logprobs(packed.module, pack(seqs, packed.device), 1.0)
            b, _ = padded_logprobs(padded.module, seqs, 1.0, padded.device)
    finally:
        packed.shutdown()
        padded.shutdown()
    diff = float((a - b).abs().max())
    tolerance = 1e-3 if dtype == "float32" else 0.1
    return (f"packed = padded logprobs ({dtype})", "ok" if diff <= tolerance else "MISMATCH",
            f"max |diff| {diff:.2e} (tolerance {tolerance:g}), {a.numel()} tokens")


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


def fsdp2_check(setup: Setup) -> Row:
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    device, cuda = setup.device, setup.device.type == "cuda"
    dist.init_process_group(process_group_backend(device),
                            init_method=f"tcp://127.0.0.1:{setup.port}", rank=0,
                            world_size=1, **({"device_id": device} if cuda else {}))
    try:
        model = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=torch.float32)
        policy: dict[str, Any] = dict(
            offload_policy=CPUOffloadPolicy(pin_memory=cuda),  # pinning needs a GPU
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.float32))
        for layer in model.model.layers:
            fully_shard(layer, **policy)
        fully_shard(model, **policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(3, model.config.vocab_size, setup.scale.fsdp_batch, device=device)
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
        rows, tokens = setup.scale.fsdp_batch
        last = float(loss.detach())
        return ("FSDP2 + pinned CPUOffloadPolicy (1 rank)",
                "ok" if math.isfinite(last) else "NON-FINITE",
                f"{step_s * 1e3:.0f} ms/step ({rows} x {tokens}), loss {last:.3f}, "
                f"shards on {where}, GPU peak "
                f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
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
    backend = process_group_backend(torch.device("cuda"),
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
