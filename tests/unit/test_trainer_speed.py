"""The trainer's accelerator path, checked on the CPU: host offsets and one copy per
micro-batch, the CUDA attention layout (one varlen call per layer) emulated, the fused
LM head, no host read inside a micro-batch, statistics read once a step (on several
shards too, whose wait for each other blocks no accelerator's host), phase times from
CUDA events, the compile switch.

What needs a GPU (the flash kernels themselves, sync counts, MFU) is a row of
``scripts/gpu-check.sh``; here the kernel is swapped for a CPU emulation that takes the
exact arguments the CUDA call gets (``(T, H, d)`` tensors, int32 offsets, the rounded
``max_len``), so the layout, the offsets and their wiring through transformers are what
is tested.
"""

from __future__ import annotations

import collections
import copy
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from host_reads import HostReads
from test_packing import SHAPES, TEMPERATURE, sequences, shard, shard_batch
from transformers import Qwen2ForCausalLM

from async_rl.models.tiny_model import build_config
from buffers.common.records import TrainSequence
from buffers.common.train_records import ShardStepResult
from workers.model_config import ModelConfig
from workers.rollout.config import Sampling
from workers.trainer import attention
from workers.trainer.attention import round_up_pow2, use_packed_attention
from workers.trainer.config import TrainerConfig
from workers.trainer.device_setup import decoder_layers, speed_up
from workers.trainer.lm_head import CHUNK_ELEMENTS, chunk_rows, head_logprobs
from workers.trainer.loss import Normaliser, read_stats
from workers.trainer.packing import (
    _through_one_buffer,
    completion_logprobs,
    pack,
    packed_forward,
    padded_logits,
    token_entropy,
)
from workers.trainer.phase_clock import PhaseClock
from workers.trainer.shard import TrainerShard
from workers.trainer.spec import TrainerSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.fixture(scope="module")
def reference() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(build_config())
    model.train()
    return model


@pytest.fixture(scope="module")
def packed_model(reference: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    model = copy.deepcopy(reference)
    assert use_packed_attention(model)
    return model


@pytest.fixture(scope="module")
def model_dir(reference: Qwen2ForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("speed-model")
    reference.save_pretrained(out)
    return out


# -- pack: offsets on the host, one copy ------------------------------------------------


def test_pack_gives_the_offsets_on_the_host() -> None:
    seqs = sequences()
    batch = pack(seqs)
    lengths = tuple(p + c for p, c in SHAPES)
    assert batch.lengths == lengths and batch.max_len == max(lengths)
    assert batch.cu_seqlens_host.dtype == batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens_host.tolist() == [0, *np.cumsum(lengths).tolist()]
    assert batch.cu_seqlens is batch.cu_seqlens_host  # on the CPU: no copy at all
    (one,) = sequences([(1, 1)])
    single = pack([one])
    assert single.lengths == (2,) and single.max_len == 2
    assert single.cu_seqlens_host.tolist() == [0, 2]


def test_one_buffer_carries_every_tensor_back_exactly() -> None:
    parts = [torch.arange(6).view(1, 6), torch.tensor([5, -1]), torch.arange(3, dtype=torch.int32),
             torch.tensor([0.5, -2.25], dtype=torch.float32), torch.zeros(0, dtype=torch.float32)]
    back = _through_one_buffer(parts, torch.device("cpu"))
    assert len(back) == len(parts)
    for got, want in zip(back, parts, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    # They are views of one buffer: one host-to-device copy.
    assert len({t.untyped_storage().data_ptr() for t in back}) == 1
    meta = _through_one_buffer(parts, torch.device("meta"))
    assert [t.device.type for t in meta] == ["meta"] * len(parts)


def test_max_len_is_rounded_up_to_a_power_of_two() -> None:
    assert [round_up_pow2(n) for n in (1, 2, 3, 4, 5, 300, 1024, 1025)] == [
        1, 2, 4, 4, 8, 512, 1024, 2048]


# -- the CUDA attention layout, emulated ------------------------------------------------


class EmulatedVarlen:
    """What the flash varlen call computes, on the CPU, from the same arguments: causal
    attention per sequence, within ``window`` tokens where the call gives one (the mask
    transformers' own sliding-window layers build)."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], int, int | None]] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                 max_len: int, scale: float | None, window: int | None) -> torch.Tensor:
        assert q.dim() == k.dim() == v.dim() == 3 and q.shape[0] == k.shape[0] == v.shape[0]
        assert cu.dtype == torch.int32 and q.dtype == k.dtype == v.dtype
        offsets = cu.tolist()  # the kernel reads them on the device; the emulation here
        lengths = [b - a for a, b in itertools.pairwise(offsets)]
        assert offsets[-1] == q.shape[0] and max(lengths) <= max_len
        self.calls.append((tuple(lengths), max_len, window))
        parts = [F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
            attn_mask=transformers_mask(b - a, window), scale=scale,
            enable_gqa=k.shape[1] != q.shape[1]).transpose(0, 1)
            for a, b in itertools.pairwise(offsets)]
        return torch.cat(parts)


def transformers_mask(length: int, window: int | None) -> torch.Tensor:
    """``(length, length)``: which keys each query sees in transformers' own causal
    (``window`` None) or sliding-window mask."""
    from transformers.masking_utils import (
        causal_mask_function,
        sliding_window_causal_mask_function,
    )

    allowed = (causal_mask_function if window is None
               else sliding_window_causal_mask_function(window))
    index = torch.arange(length)
    return allowed(0, 0, index[:, None], index[None, :])


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> EmulatedVarlen:
    kernel = EmulatedVarlen()
    monkeypatch.setattr(attention, "varlen_kernel", lambda device, dtype, windowed: kernel)
    return kernel


def weighted_grads(model: torch.nn.Module, logprobs: torch.Tensor) -> torch.Tensor:
    """Every parameter's gradient of a weighted sum of the logprobs, flattened."""
    weights = torch.linspace(-1.0, 2.0, logprobs.numel())
    model.zero_grad(set_to_none=True)
    (logprobs * weights).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_the_varlen_layout_equals_the_padded_reference_in_value_and_gradient(
        reference: Qwen2ForCausalLM, packed_model: Qwen2ForCausalLM,
        emulated: EmulatedVarlen) -> None:
    seqs = sequences()
    batch = pack(seqs)
    logprobs, entropy = packed_forward(packed_model, packed_model, batch, TEMPERATURE)
    layers = build_config().num_hidden_layers
    assert emulated.calls == [(batch.lengths, round_up_pow2(batch.max_len), None)] * layers
    logits, targets, _ = padded_logits(reference, seqs)
    want = completion_logprobs(logits, targets, TEMPERATURE)
    assert logprobs.shape == want.shape == (sum(c for _, c in SHAPES),)
    torch.testing.assert_close(logprobs, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, token_entropy(logits, TEMPERATURE), rtol=0, atol=1e-5)
    got_grad = weighted_grads(packed_model, logprobs)
    want_grad = weighted_grads(reference, completion_logprobs(
        padded_logits(reference, seqs)[0], targets, TEMPERATURE))
    assert got_grad.numel() == want_grad.numel() > 0
    assert float((got_grad - want_grad).norm() / want_grad.norm()) <= 1e-5


def test_the_cpu_loop_equals_the_padded_reference_in_value_and_gradient(
        reference: Qwen2ForCausalLM, packed_model: Qwen2ForCausalLM) -> None:
    seqs = sequences()
    logprobs, _ = packed_forward(packed_model, packed_model, pack(seqs), TEMPERATURE)
    logits, targets, _ = padded_logits(reference, seqs)
    torch.testing.assert_close(logprobs, completion_logprobs(logits, targets, TEMPERATURE),
                               rtol=0, atol=1e-5)
    got_grad = weighted_grads(packed_model, logprobs)
    want_grad = weighted_grads(reference, completion_logprobs(
        padded_logits(reference, seqs)[0], targets, TEMPERATURE))
    assert float((got_grad - want_grad).norm() / want_grad.norm()) <= 1e-5


def test_a_varlen_call_gets_q_k_v_in_autocasts_dtype(
        packed_model: Qwen2ForCausalLM, emulated: EmulatedVarlen,
        monkeypatch: pytest.MonkeyPatch) -> None:
    dtypes: list[torch.dtype] = []

    def kernel(q: torch.Tensor, *rest: Any) -> torch.Tensor:
        dtypes.append(q.dtype)
        return emulated(q, *rest)

    monkeypatch.setattr(attention, "varlen_kernel", lambda device, dtype, windowed: kernel)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed_forward(packed_model, packed_model, pack(sequences()), TEMPERATURE)
    assert dtypes == [torch.bfloat16] * build_config().num_hidden_layers


def test_the_kernel_is_picked_by_device_and_dtype_and_the_torch_signature(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.attention.varlen as varlen

    cuda = torch.device("cuda", 0)
    assert attention.varlen_kernel(torch.device("cpu"), torch.bfloat16) is None
    assert attention.varlen_kernel(cuda, torch.float32) is None  # flash takes no fp32
    flashed: list[int] = []
    monkeypatch.setattr(attention, "_flash_forward",
                        lambda q, k, v, cu, n, scale, window: flashed.append(k.shape[1]) or q)
    seen: list[dict[str, Any]] = []

    def newer(*args: Any, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
              enable_gqa: bool = False, num_splits: int | None = None) -> torch.Tensor:
        seen.append({"window_size": window_size, "enable_gqa": enable_gqa, "scale": scale})
        return args[0]

    def older(*args: Any, is_causal: bool = False, scale: float | None = None,
              return_aux: Any = None) -> torch.Tensor:
        seen.append({"is_causal": is_causal, "scale": scale})
        return args[0]

    q, kv = torch.zeros(5, 4, 8), torch.zeros(5, 2, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    for fake in (newer, older):
        monkeypatch.setattr(varlen, "varlen_attn", fake)
        monkeypatch.setattr(attention, "TORCH_VARLEN", attention._varlen_attn_call())
        kernel = attention.varlen_kernel(cuda, torch.bfloat16)
        assert kernel is not None and kernel is not attention._flash_forward
        kernel(q, q, q, cu, 4, 0.5, None)  # equal heads: always torch's call
        kernel(q, kv, kv, cu, 4, 0.5, None)  # grouped-query heads
    assert seen == [{"window_size": (-1, 0), "enable_gqa": False, "scale": 0.5},
                    {"window_size": (-1, 0), "enable_gqa": True, "scale": 0.5},
                    {"is_causal": True, "scale": 0.5}]
    assert flashed == [2]  # the older signature has no enable_gqa: flash takes GQA itself
    monkeypatch.setattr(varlen, "varlen_attn", lambda *a, scale=None: a[0])  # no causal
    monkeypatch.setattr(attention, "TORCH_VARLEN", attention._varlen_attn_call())
    assert attention.TORCH_VARLEN is None
    assert attention.varlen_kernel(cuda, torch.float16) is attention._flash_forward
    monkeypatch.delattr(varlen, "varlen_attn")
    assert attention._varlen_attn_call() is None  # a torch without it


def test_kernel_name_says_which_kernel_varlen_kernel_picked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The name bench/trainer/gpu_check.py reports its attention rows under."""
    cuda = torch.device("cuda")
    assert attention.kernel_name(attention.varlen_kernel(torch.device("cpu"),
                                                         torch.bfloat16)) == "per-sequence loop"
    assert attention.kernel_name(attention.varlen_kernel(cuda, torch.float32)) \
        == "per-sequence loop"
    monkeypatch.setattr(attention, "TORCH_VARLEN", lambda *args: args[0])
    assert attention.kernel_name(attention.varlen_kernel(cuda, torch.bfloat16)) \
        == "torch varlen_attn"
    monkeypatch.setattr(attention, "TORCH_VARLEN", None)
    assert attention.kernel_name(attention.varlen_kernel(cuda, torch.bfloat16)) \
        == "aten._flash_attention_forward"


# -- the fused head ---------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 4, 7, 64])
def test_the_fused_head_equals_full_logits_in_value_and_gradient(rows: int) -> None:
    gen = torch.Generator().manual_seed(7)
    n, hidden, vocab = 13, 16, 301
    h = torch.randn(n, hidden, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)
    logprobs, entropy = head_logprobs(h, weight, None, targets, TEMPERATURE, rows=rows)
    assert logprobs.dtype == entropy.dtype == torch.float32 and logprobs.shape == (n,)
    assert logprobs.requires_grad and not entropy.requires_grad
    got = torch.autograd.grad((logprobs * upstream).sum(), (h, weight))
    logits = F.linear(h, weight)
    want_logprobs = completion_logprobs(logits, targets, TEMPERATURE, rows=n)
    want = torch.autograd.grad((want_logprobs * upstream).sum(), (h, weight))
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, token_entropy(logits, TEMPERATURE), rtol=0, atol=1e-5)
    for a, b in zip(got, want, strict=True):
        assert float((a - b).norm() / b.norm()) <= 1e-5
    empty_lp, empty_entropy = head_logprobs(h[:0], weight, None, targets[:0], 1.0)
    assert empty_lp.shape == empty_entropy.shape == (0,)


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_fused_head_under_bf16_autocast_matches_f_linear(with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(8)
    n, hidden, vocab = 9, 32, 130
    h = torch.randn(n, hidden, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=gen, requires_grad=True)
    bias = torch.randn(vocab, generator=gen, requires_grad=True) if with_bias else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)
    inputs = (h, weight) if bias is None else (h, weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, entropy = head_logprobs(h, weight, bias, targets, TEMPERATURE, rows=4)
        logits = F.linear(h, weight, bias)
        assert logits.dtype == torch.bfloat16
        want = completion_logprobs(logits, targets, TEMPERATURE)
    torch.testing.assert_close(logprobs, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, token_entropy(logits, TEMPERATURE), rtol=0, atol=1e-5)
    got = torch.autograd.grad((logprobs * upstream).sum(), inputs)
    expected = torch.autograd.grad((want * upstream).sum(), inputs)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # bf16 products


def test_chunks_hold_a_fixed_number_of_logits_whatever_the_vocabulary() -> None:
    assert chunk_rows(151_936) == CHUNK_ELEMENTS // 151_936 > 100
    assert chunk_rows(264) * 264 <= CHUNK_ELEMENTS < (chunk_rows(264) + 1) * 264
    assert chunk_rows(CHUNK_ELEMENTS * 2) == 1


def test_the_fused_head_keeps_no_vocabulary_sized_tensor_for_backward() -> None:
    n, hidden, vocab, rows = 64, 8, 4096, 16
    h = torch.randn(n, hidden, requires_grad=True)
    weight = torch.randn(vocab, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.shape) or t, lambda t: t):
        logprobs, _ = head_logprobs(h, weight, None, targets, 1.0, rows=rows)
    assert saved  # something is kept: the inputs of each chunk
    assert all(s.numel() < rows * vocab for s in saved if len(s) == 2 and s[0] != vocab)
    assert not any(s == (n, vocab) or s == (rows, vocab) for s in saved)
    logprobs.sum().backward()
    assert h.grad is not None and weight.grad is not None


# -- host reads -------------------------------------------------------------------------


def test_a_micro_batch_forward_and_backward_read_nothing_on_the_host(model_dir: Path) -> None:
    trainer = shard(model_dir, packed=True)
    (micro_batch,) = trainer.losses.prepare([tuple(sequences())])
    for agg in ("token_mean", "seq_mean_token_mean"):
        norm = Normaliser(agg=agg, tokens=100, sequences=4)  # type: ignore[arg-type]
        with HostReads() as reads:
            loss, stats, positions = trainer.losses.micro_batch(micro_batch, norm)
            loss.backward()
        assert reads.seen == collections.Counter()
        assert stats is not None and positions == micro_batch.packed.num_tokens  # type: ignore[union-attr]
        assert read_stats([stats]).tokens == sum(c for _, c in SHAPES)


def test_a_step_reads_the_host_twice_statistics_and_gradient_norm(model_dir: Path) -> None:
    seqs = sequences()
    batch, tokens = shard_batch([seqs[:2], seqs[2:], []])
    trainer = shard(model_dir, packed=True)
    with HostReads() as reads:
        result = trainer.train_step(batch, tokens)
    assert sum(reads.seen.values()) <= 2
    assert reads.seen == collections.Counter({"tolist": 1, "__float__": 1})
    assert result.loss.tokens == sum(c for _, c in SHAPES)
    assert result.forward_s > 0 and result.backward_s > 0 and result.optimizer_s > 0


def test_a_step_on_several_shards_still_reads_the_host_twice(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counts every shard agrees on are the host's: summed where they are (the
    group's CPU backend), not sent to the device and read back."""
    seqs = sequences()
    batch, tokens = shard_batch([seqs[:2], seqs[2:]])
    trainer = shard(model_dir, packed=True)
    trainer.world_size = trainer.losses.world_size = 2  # the collectives faked below
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: tensor.mul_(2))
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    with HostReads() as reads:
        result = trainer.train_step(batch, tokens)
    assert reads.seen == collections.Counter({"tolist": 1, "__float__": 1})
    assert result.loss.tokens == sum(c for _, c in SHAPES)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_shards_wait_for_each_other_on_the_host_only_on_the_cpu(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """Before an update's last backward the shards wait for each other, so that the
    phases tell that wait from the gradient all-reduce. On the CPU the host waits (a
    gloo barrier); on an accelerator ("meta" stands in for CUDA) a barrier would block
    the host at every update (NCCL's does), so only the device's stream waits, on a
    one-element all-reduce."""
    waited: list[str] = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: waited.append("host"))
    monkeypatch.setattr(dist, "all_reduce",
                        lambda tensor, *a, **k: waited.append(f"{tensor.device.type} stream"))
    trainer = shard(model_dir, packed=True)
    trainer.world_size = 2
    trainer.device = torch.device(device)  # what the wait is on; the model stays on the CPU
    seqs = sequences()
    micro_batches = trainer.losses.prepare([tuple(seqs[:2]), tuple(seqs[2:])])
    norm = Normaliser(agg="token_mean", tokens=sum(c for _, c in SHAPES), sequences=4)
    _, grad_norm = trainer._update(micro_batches, norm, [None, None], [None, None], [],
                                   PhaseClock(torch.device("cpu")))
    assert grad_norm > 0
    assert waited == (["host"] if device == "cpu" else ["meta stream"])


def test_statistics_read_once_equal_each_micro_batch_read_alone(model_dir: Path) -> None:
    trainer = shard(model_dir, packed=True)
    seqs = sequences()
    prepared = trainer.losses.prepare([tuple(seqs[:2]), tuple(seqs[2:])])
    norm = Normaliser(agg="token_mean", tokens=sum(c for _, c in SHAPES), sequences=4)
    parts = []
    for micro_batch in prepared:
        _, stats, _ = trainer.losses.micro_batch(micro_batch, norm)
        assert stats is not None
        parts.append(stats)
    alone = [read_stats([p]) for p in parts]
    both = read_stats(parts)
    assert both.tokens == sum(a.tokens for a in alone) == sum(c for _, c in SHAPES)
    assert both.loss_sum == pytest.approx(sum(a.loss_sum for a in alone), rel=1e-12)
    assert both.is_weight_max == max(a.is_weight_max for a in alone)
    assert both.clipped == sum(a.clipped for a in alone)
    assert isinstance(both.clipped, int)


# -- phase times, compile ---------------------------------------------------------------


def test_phase_times_on_cuda_come_from_events_without_a_sync(
        monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(a))
    recorded: list[float] = []
    waited: list[float] = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = 0.0

        def record(self) -> None:
            self.at = float(len(recorded))  # one "millisecond" per boundary
            recorded.append(self.at)

        def elapsed_time(self, other: Event) -> float:
            return other.at - self.at

        def synchronize(self) -> None:
            waited.append(self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = PhaseClock(torch.device("cuda", 0))
    for phase in ("forward", "backward", "forward", None, "optimizer"):
        clock.start(phase)
    assert clock.totals() == pytest.approx({"forward": 2e-3, "backward": 1e-3,
                                            "optimizer": 1e-3})
    assert synced == [] and len(recorded) == 6 and waited == [5.0]  # the last event only
    clock.start("forward")
    clock.start(None)  # ended before the step's read: totals adds no boundary
    assert clock.totals() == pytest.approx({"forward": 1e-3})
    assert len(recorded) == 8 and waited == [5.0, 7.0]
    cpu = PhaseClock(torch.device("cpu"))
    cpu.start("forward")
    times = cpu.totals()
    assert list(times) == ["forward"] and times["forward"] >= 0


def test_compile_defaults_off_on_the_cpu_and_keeps_state_dict_names(
        reference: Qwen2ForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # Where else it is on by default: tests/unit/test_gpu_paths.py.
    cpu = torch.device("cpu")
    compiled: list[Any] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    model = copy.deepcopy(reference)
    names = list(model.state_dict())
    assert speed_up(model, TrainerConfig(), cpu) == 0 and compiled == []
    layers = decoder_layers(model)
    assert len(layers) == build_config().num_hidden_layers
    assert speed_up(model, TrainerConfig(compile=True), cpu) == len(layers)
    assert compiled == [{"dynamic": True}] * len(layers)
    assert list(model.state_dict()) == names
    assert all("forward" in vars(layer) for layer in layers)


def test_tf32_is_switched_on_for_float32_compute_on_cuda_only(
        reference: Qwen2ForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    matmul = SimpleNamespace(allow_tf32=False)
    cudnn = SimpleNamespace(allow_tf32=False)
    monkeypatch.setattr(torch.backends.cuda, "matmul", matmul)
    monkeypatch.setattr(torch.backends, "cudnn", cudnn)
    off = TrainerConfig(compile=False)
    speed_up(reference, off, torch.device("cpu"))
    speed_up(reference, TrainerConfig(compile=False, compute_dtype="bfloat16"),
             torch.device("cuda", 0))
    assert not matmul.allow_tf32 and not cudnn.allow_tf32
    speed_up(reference, off, torch.device("cuda", 0))
    assert matmul.allow_tf32 and cudnn.allow_tf32


def test_a_one_sequence_micro_batch_and_a_one_token_completion(
        reference: Qwen2ForCausalLM, packed_model: Qwen2ForCausalLM,
        emulated: EmulatedVarlen) -> None:
    (seq,) = sequences([(1, 1)])
    empty = TrainSequence(prompt_token_ids=(7, 8), completion_token_ids=(),
                          behaviour_logprobs=(), advantage=0.0)
    for seqs in ([seq], [empty, seq]):
        logprobs, _ = packed_forward(packed_model, packed_model, pack(seqs), TEMPERATURE)
        logits, targets, _ = padded_logits(reference, [seq])
        torch.testing.assert_close(logprobs, completion_logprobs(logits, targets, TEMPERATURE),
                                   rtol=0, atol=1e-5)
    assert len(emulated.calls) == 2 * build_config().num_hidden_layers


@pytest.mark.parametrize("updates", [(2,), (1, 1)])  # (1, 1): a proximal pass first
def test_fsdp2_takes_the_fused_head_through_its_root_as_a_plain_shard_does(
        model_dir: Path, updates: tuple[int, ...]) -> None:
    # The fused head reads the root's (unsharded) head weight after the forward and its
    # hidden states come back as the forward's output, so FSDP2's root hooks see them.
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    seqs = sequences()
    batch, tokens = shard_batch([seqs[:2], seqs[2:]], updates)
    plain = shard(model_dir, packed=True, mini_batches=len(updates))
    config = TrainerConfig(backend="fsdp2", max_grad_norm=1e9, mini_batches=len(updates))
    sharded = TrainerShard(TrainerSpec(
        rank=0, world_size=1, model=ModelConfig(path=str(model_dir)), trainer=config, seed=0,
        sampling=Sampling(temperature=TEMPERATURE), record_spans=False, master_port=port))
    sharded.setup()
    try:
        a, b = plain.train_step(batch, tokens), sharded.train_step(batch, tokens)
        after = {k: v.clone() for k, v in sharded.policy_state().items()}
    finally:
        sharded.shutdown()
    assert a.loss.tokens == b.loss.tokens == sum(c for _, c in SHAPES)
    assert b.loss.loss_sum == pytest.approx(a.loss.loss_sum, rel=1e-5, abs=1e-6)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    want = plain.module.state_dict()
    assert len(after) == len(want) > 0
    for name, value in after.items():
        torch.testing.assert_close(value, want[name], atol=1e-6, rtol=1e-5)


def compiled_and_eager_steps(model_dir: Path, seqs: list[TrainSequence],
                             monkeypatch: pytest.MonkeyPatch
                             ) -> tuple[TrainerShard, ShardStepResult, ShardStepResult]:
    """(the compiled shard, its step, an eager shard's step) on ``seqs`` in two
    micro-batches, compiled with dynamo's eager backend: the tracing (what a graph break
    would cut) without inductor's code generation. Asserts the graphs break only at the
    per-sequence loops, which stay out of the graph on purpose (on the CPU the attention
    is ``attention._uncompiled_loop``; a linear-attention layer runs
    ``linear_attention._each_sequence``)."""
    import functools

    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    try:
        batch, tokens = shard_batch([seqs[:2], seqs[2:]])
        eager, compiled = shard(model_dir, packed=True), shard(model_dir, packed=True,
                                                               compile=True)
        assert compiled.compiled_layers == len(decoder_layers(compiled.module)) > 0
        a, b = eager.train_step(batch, tokens), compiled.train_step(batch, tokens)
        breaks = dict(counters["graph_break"])
        assert breaks and all("_uncompiled_loop" in reason or "_each_sequence" in reason
                              for reason in breaks), breaks
        assert counters["stats"]["unique_graphs"] >= 1
    finally:
        torch._dynamo.reset()
    assert b.loss.tokens == a.loss.tokens > 0
    assert b.loss.loss_sum == pytest.approx(a.loss.loss_sum, rel=1e-6)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-6)
    return compiled, b, a


def test_compiled_layers_break_only_at_the_loop_and_train_as_eager_ones(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled, _, _ = compiled_and_eager_steps(model_dir, sequences(), monkeypatch)
    assert len(decoder_layers(compiled.module)) == build_config().num_hidden_layers
    assert compiled.compiled_layers == 0  # the first step logged its time once
