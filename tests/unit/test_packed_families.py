"""The packed path on the families whose attention differs from Qwen2's: sliding windows
(mistral, gemma2, gemma3's local layers, gpt-oss's alternate layers), Gemma 2's
attention soft-capping, gpt-oss's attention sinks, and the hybrid models' linear
attention (qwen3_next, qwen3_5_moe), each against the model's own padded eager forward;
the CUDA kernels' window arguments, built on the CPU with the kernels stubbed; their
layers compiled (trainer.compile) without a graph break.

The models are ``async_rl.models.families``' tiny random ones (a window of 8 tokens, so
it binds on these sequences). The log-probs here come through the model's own head
(``packed_logits``): the fused head is checked in ``test_trainer_speed.py`` and the
model matrix, the attention here.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from test_packing import TEMPERATURE, sequences
from test_trainer_speed import (
    EmulatedVarlen,
    compiled_and_eager_steps,
    transformers_mask,
    weighted_grads,
)
from transformers import AutoModelForCausalLM

from async_rl.models.families import SLIDING_WINDOW, build_family_model, tiny_config
from workers.trainer import attention
from workers.trainer.attention import (
    HostLengths,
    attention_kwargs,
    round_up_pow2,
    use_packed_attention,
)
from workers.trainer.device_setup import decoder_layers
from workers.trainer.linear_attention import PerSequence, split_linear_attention
from workers.trainer.packing import (
    completion_logprobs,
    pack,
    packed_logits,
    padded_logits,
    token_entropy,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPES = [(4, 3), (6, 17), (2, 30), (9, 5), (1, 1)]
"""(prompt, completion): sequences longer and shorter than the window, a one-token
completion after a one-token prompt."""
FAMILIES = ("mistral", "gemma2", "gemma3", "gpt_oss", "qwen3_next", "qwen3_5_moe")


def eager_model(arch: str) -> torch.nn.Module:
    """``arch``'s tiny random model with transformers' eager attention, in train mode
    (dropout is 0 in every tiny config)."""
    config = tiny_config(arch)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()


def eager_and_packed(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``arch``'s eager model and a copy of it switched to packed attention."""
    reference = eager_model(arch)
    packed = copy.deepcopy(reference)
    assert use_packed_attention(packed)
    return reference, packed


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, torch.nn.Module]:
    """(architecture, its eager model, a copy switched to packed attention)."""
    return request.param, *eager_and_packed(request.param)


def packed_and_padded(reference: torch.nn.Module, packed: torch.nn.Module,
                      shapes: list[tuple[int, int]]) -> None:
    """Packed log-probs, entropy and gradients equal the padded eager forward's."""
    seqs = sequences(shapes)
    logits = packed_logits(packed, pack(seqs))
    want_logits, targets, _ = padded_logits(reference, seqs)
    got = completion_logprobs(logits, targets, TEMPERATURE)
    want = completion_logprobs(want_logits, targets, TEMPERATURE)
    assert got.shape == want.shape == (sum(c for _, c in shapes),)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(token_entropy(logits, TEMPERATURE),
                               token_entropy(want_logits, TEMPERATURE), rtol=0, atol=1e-5)
    got_grad, want_grad = weighted_grads(packed, got), weighted_grads(reference, want)
    # Every parameter has a gradient in both (a sink or a layer left out would not).
    assert got_grad.numel() == want_grad.numel() > 0
    assert float((got_grad - want_grad).norm() / want_grad.norm()) <= 1e-5


def test_packed_attention_equals_the_families_padded_eager_forward(
        family: tuple[str, torch.nn.Module, torch.nn.Module]) -> None:
    _, reference, packed = family
    packed_and_padded(reference, packed, SHAPES)


def test_one_sequence_and_sequences_within_the_window(
        family: tuple[str, torch.nn.Module, torch.nn.Module]) -> None:
    _, reference, packed = family
    packed_and_padded(reference, packed, [(5, 20)])
    short = [(2, 3), (1, 1), (3, SLIDING_WINDOW - 3)]  # every one within the window
    packed_and_padded(reference, packed, short)


# -- the window ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3, SLIDING_WINDOW, 40])
def test_the_loop_sees_the_tokens_transformers_sliding_window_sees(window: int) -> None:
    gen = torch.Generator().manual_seed(window)
    lengths = (11, 1, 6)
    q, k, v = (torch.randn(1, heads, sum(lengths), 8, generator=gen) for heads in (4, 2, 2))
    got = attention.per_sequence_attention(q, k, v, lengths, 0.0, None, window)
    starts = [0, *itertools.accumulate(lengths)]
    for (a, b), n in zip(itertools.pairwise(starts), lengths, strict=True):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], attn_mask=transformers_mask(n, window),
            enable_gqa=True)
        torch.testing.assert_close(got[:, :, a:b], want, rtol=0, atol=1e-6)
    # A window of one token is each token attending to itself only: its own value.
    if window == 1:
        torch.testing.assert_close(got, v.repeat_interleave(2, 1), rtol=0, atol=1e-6)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> tuple[EmulatedVarlen, list[bool]]:
    """The CUDA kernel emulated, and whether each layer asked for a windowed one."""
    kernel, asked = EmulatedVarlen(), []

    def pick(device: torch.device, dtype: torch.dtype, *, windowed: bool = False
             ) -> EmulatedVarlen:
        asked.append(windowed)
        return kernel

    monkeypatch.setattr(attention, "varlen_kernel", pick)
    return kernel, asked


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_a_windowed_layer_gives_the_kernel_its_window(
        arch: str, emulated: tuple[EmulatedVarlen, list[bool]]) -> None:
    kernel, asked = emulated
    reference, packed = eager_and_packed(arch)
    packed_and_padded(reference, packed, SHAPES)
    lengths = tuple(p + c for p, c in SHAPES)
    # mistral: a window on every layer; gemma3: the first layer's, not the second.
    windows = [SLIDING_WINDOW] * 2 if arch == "mistral" else [SLIDING_WINDOW, None]
    assert kernel.calls == [(lengths, round_up_pow2(max(lengths)), w) for w in windows]
    assert asked == [w is not None for w in windows]
    # A window no sequence reaches is no window: the plain causal call.
    kernel.calls.clear()
    packed_and_padded(reference, packed, [(2, 3), (1, 4)])
    assert [call[2] for call in kernel.calls] == [None, None]


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_soft_capping_and_sinks_run_the_loop_not_the_kernel(
        arch: str, emulated: tuple[EmulatedVarlen, list[bool]]) -> None:
    kernel, asked = emulated
    packed_and_padded(*eager_and_packed(arch), SHAPES)
    assert kernel.calls == [] and asked == []  # flash takes neither


def test_the_torch_and_flash_calls_get_the_window_as_flash_counts_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' window counts the query itself; flash's left window does not."""
    import torch.nn.attention.varlen as varlen

    cuda = torch.device("cuda", 0)
    seen: list[dict[str, Any]] = []

    def newer(*args: Any, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
              enable_gqa: bool = False) -> torch.Tensor:
        seen.append({"window_size": window_size, "enable_gqa": enable_gqa})
        return args[0]

    def older(*args: Any, is_causal: bool = False, scale: float | None = None
              ) -> torch.Tensor:
        seen.append({"is_causal": is_causal})
        return args[0]

    def flash(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        seen.append({"flash": kwargs})
        return (args[0],)

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", flash)
    q, kv = torch.zeros(5, 4, 8), torch.zeros(5, 2, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    for fake in (newer, older):
        monkeypatch.setattr(varlen, "varlen_attn", fake)
        monkeypatch.setattr(attention, "TORCH_VARLEN", attention._varlen_attn_call())
        kernel = attention.varlen_kernel(cuda, torch.bfloat16, windowed=True)
        assert kernel is attention.TORCH_VARLEN is not None
        kernel(q, kv, kv, cu, 4, 0.5, 3)
        kernel(q, kv, kv, cu, 4, 0.5, None)
    flash_window = {"scale": 0.5, "window_size_left": 2, "window_size_right": 0}
    assert seen == [{"window_size": (2, 0), "enable_gqa": True},
                    {"window_size": (-1, 0), "enable_gqa": True},
                    {"flash": flash_window},  # the older signature has no window
                    {"flash": {"scale": 0.5}}]  # nor enable_gqa: flash takes GQA itself
    monkeypatch.setattr(attention, "TORCH_VARLEN", None)
    seen.clear()
    attention._flash_forward(q, q, q, cu, 4, None, 1)  # a window of one: the query only
    assert seen == [{"flash": {"scale": None, "window_size_left": 0,
                               "window_size_right": 0}}]
    # A flash without window arguments: a windowed layer runs the loop, the others flash.
    monkeypatch.setattr(attention, "FLASH_WINDOW", False)
    assert attention.varlen_kernel(cuda, torch.bfloat16, windowed=True) is None
    assert attention.varlen_kernel(cuda, torch.bfloat16) is attention._flash_forward


def test_this_torchs_flash_takes_a_window() -> None:
    assert attention._flash_takes_window() is attention.FLASH_WINDOW is True


# -- hybrid linear attention ----------------------------------------------------------------


def test_linear_attention_is_split_once_and_a_padded_call_is_the_forward_itself() -> None:
    model = eager_model("qwen3_next")
    mixers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert len(mixers) == 1
    forward = mixers[0].forward
    assert split_linear_attention(model) == 1 == split_linear_attention(model)
    wrapped = mixers[0].forward
    assert isinstance(wrapped, PerSequence) and wrapped.forward == forward
    hidden = torch.randn(2, 5, model.config.hidden_size)
    torch.testing.assert_close(wrapped(hidden_states=hidden), forward(hidden_states=hidden),
                               rtol=0, atol=0)
    assert split_linear_attention(eager_model("mistral")) == 0


def test_each_packed_sequence_starts_the_recurrence_from_zero() -> None:
    """The layer itself: a packed row's output is each sequence's own forward."""
    model = eager_model("qwen3_5_moe")
    (mixer,) = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    forward = mixer.forward
    split_linear_attention(model)
    lengths = (7, 1, 12)
    hidden = torch.randn(1, sum(lengths), model.config.hidden_size)
    offsets = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    got = mixer(hidden_states=hidden, packed_lengths=HostLengths(lengths), cu_seq_lens_q=offsets,
                cu_seq_lens_k=offsets, max_length_q=16, max_length_k=16)
    want = torch.cat([forward(hidden_states=part) for part in hidden.split(lengths, 1)], 1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with torch.no_grad():  # what the row gave before: the state carried over
        whole = forward(hidden_states=hidden)
    assert float((whole[:, 7:] - want[:, 7:]).detach().abs().max()) > 1e-3


# -- trainer.compile ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "qwen3_next"])
def test_compiled_layers_of_the_families_break_only_at_the_loops_and_train_as_eager_ones(
        arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.compile over windows, soft-capping, sinks and the per-sequence linear
    attention."""
    model_dir = build_family_model(arch, tmp_path / arch)
    compiled, step, _ = compiled_and_eager_steps(model_dir, sequences(SHAPES), monkeypatch)
    assert len(decoder_layers(compiled.module)) == tiny_config(arch).num_hidden_layers
    assert step.loss.tokens == sum(c for _, c in SHAPES)


def test_a_compiled_linear_attention_layer_keeps_its_graphs_whatever_the_sequence_count(
        ) -> None:
    """The split runs outside the graph (``linear_attention._each_sequence``): traced, it
    would compile the layer again for every new sequence count."""
    import numpy as np
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    model = eager_model("qwen3_next")
    use_packed_attention(model)
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    assert layer.linear_attn is not None and model.config.layer_types[0] == "linear_attention"
    counter = CompileCounter()
    torch._dynamo.reset()
    forward = torch.compile(layer.forward, dynamic=True, backend=counter)
    frames = []
    try:
        for lengths in [(5, 7), (3, 4, 6), (9, 2, 3, 4), (4, 4, 4, 4, 4)]:
            hidden = torch.randn(1, sum(lengths), model.config.hidden_size)
            positions = torch.cat([torch.arange(n) for n in lengths])[None]
            cu = torch.tensor(np.cumsum((0, *lengths)), dtype=torch.int32)
            kwargs = {"position_embeddings": rotary(hidden, positions),
                      "position_ids": positions, "attention_mask": None,
                      **attention_kwargs(cu, max(lengths), lengths)}
            with torch.no_grad():
                torch.testing.assert_close(forward(hidden, **kwargs), layer(hidden, **kwargs))
            frames.append(counter.frame_count)
    finally:
        torch._dynamo.reset()
    assert frames[0] >= 1
    assert frames == [frames[0]] * 4  # compiled once, for every sequence count
