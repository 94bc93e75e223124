"""The fused LM head against the models' own heads, and what one call of it costs.

The head's own logit transform (Granite's ``logits_scaling``, Cohere's ``logit_scale``,
Gemma's ``final_logit_softcapping``) read from each family's config and applied in
forward and backward; the packed forward taking it from the model; the weight cast once
a pass and its gradient made in one float32 buffer, counted at the dispatcher.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_packing import SHAPES, TEMPERATURE, sequences
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GraniteConfig,
    PretrainedConfig,
)

from async_rl.models.families import tiny_config
from workers.trainer.attention import use_packed_attention
from workers.trainer.head_transform import HeadTransform, head_transform
from workers.trainer.lm_head import head_logprobs
from workers.trainer.packing import completion_logprobs, pack, packed_forward, padded_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ("granite", "granitemoe", "cohere", "gemma2")
"""The families whose head transforms its logits (``async_rl.models.families``' tiny
configs: Granite's logits divided by 4, Cohere's times 0.25, Gemma 2's capped at 1.0)."""


def family(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    model.eval()  # no dropout: two forwards of the same rows agree
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_fused_head_equals_the_model_s_own_head_with_its_logit_transform(
        arch: str) -> None:
    # Through the model's own forward: gemma2's sliding window is the model's business.
    model = family(arch)
    ids = torch.randint(0, 256, (1, 25), generator=torch.Generator().manual_seed(1))
    targets = ids[0, 1:]
    upstream = torch.randn(24, generator=torch.Generator().manual_seed(2))
    weight = model.get_output_embeddings().weight
    captured: list[torch.Tensor] = []
    handle = model.get_decoder().register_forward_hook(
        lambda _m, _a, out: captured.append(out.last_hidden_state))
    try:
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    finally:
        handle.remove()
    want = completion_logprobs(logits, targets, TEMPERATURE)
    want_grads = torch.autograd.grad((want * upstream).sum(), (captured[0], weight))

    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    transform = head_transform(model.config)
    got, _ = head_logprobs(hidden[0, :-1], weight, None, targets, TEMPERATURE, rows=5,
                           transform=transform)
    got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert relative(a, b) <= 1e-5
    # The transform matters on these rows: without it the head is far off.
    plain, _ = head_logprobs(hidden[0, :-1], weight, None, targets, TEMPERATURE)
    assert transform != HeadTransform()
    assert float((plain - want).detach().abs().max()) > 100 * 1e-5


@pytest.mark.parametrize("arch", ["granite", "cohere"])
def test_the_packed_forward_applies_the_head_transform_of_the_model_s_config(
        arch: str) -> None:
    reference = family(arch)
    packed = copy.deepcopy(reference)
    assert use_packed_attention(packed)
    seqs = sequences(SHAPES)
    logits, targets, _ = padded_logits(reference, seqs)
    want = completion_logprobs(logits, targets, TEMPERATURE)
    got, _ = packed_forward(packed, packed, pack(seqs), TEMPERATURE)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("config", "want"), [
    (GraniteConfig(logits_scaling=8.0), HeadTransform(scale=1 / 8)),
    (CohereConfig(logit_scale=0.0625), HeadTransform(scale=0.0625)),
    (Gemma2Config(final_logit_softcapping=30.0), HeadTransform(softcap=30.0)),
    (Gemma2Config(final_logit_softcapping=None), HeadTransform()),
    (Gemma3Config(text_config=Gemma3TextConfig(final_logit_softcapping=25.0)),
     HeadTransform(softcap=25.0)),  # a composite model: its text config
    (PretrainedConfig(), HeadTransform()),
])
def test_the_head_transform_is_read_from_each_family_s_own_key(
        config: PretrainedConfig, want: HeadTransform) -> None:
    assert head_transform(config) == want


def test_logits_scaling_multiplies_where_the_model_type_says_so() -> None:
    config = PretrainedConfig(logits_scaling=2.0)
    assert head_transform(config) == HeadTransform(scale=0.5)
    config.model_type = "hyperclovax"  # muP: logits times logits_scaling
    assert head_transform(config) == HeadTransform(scale=2.0)


# -- one weight cast and one weight gradient per pass -----------------------------------


class WeightShaped(TorchDispatchMode):
    """Counts, by operator, the new ``shape``-sized tensors made while active (views and
    in-place results are not new)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = torch.Size(shape)
        self.made: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        fresh = not schema.is_mutable and not any(
            r.alias_info is not None for r in schema.returns)
        if fresh and isinstance(out, torch.Tensor) and out.shape == self.shape:
            self.made[func.overloadpacket.__name__] += 1
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_a_call_casts_the_weight_once_a_pass_and_makes_one_weight_gradient(
        autocast: bool) -> None:
    n, hidden, vocab, rows = 48, 16, 512, 8  # 6 chunks
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(n, hidden, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    with (torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
          WeightShaped(weight.shape) as forward):
        logprobs, _ = head_logprobs(h, weight, None, targets, TEMPERATURE, rows=rows)
    with WeightShaped(weight.shape) as backward:
        logprobs.sum().backward()
    casts = 1 if autocast else 0  # float32 -> bf16, once in each pass
    assert forward.made == collections.Counter({"_to_copy": casts} if casts else {})
    # Backward: the cast, and the one float32 buffer every chunk adds its share into.
    assert backward.made["_to_copy"] == casts
    assert sum(backward.made.values()) - casts == 1, backward.made
    assert weight.grad is not None and weight.grad.dtype == torch.float32


def test_a_bf16_head_s_gradients_are_within_bf16_of_the_exact_ones() -> None:
    n, hidden, vocab = 64, 32, 200
    gen = torch.Generator().manual_seed(4)
    h32 = torch.randn(n, hidden, generator=gen)
    w32 = torch.randn(vocab, hidden, generator=gen) * 0.3
    targets = torch.randint(0, vocab, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)
    h = h32.bfloat16().requires_grad_()
    weight = w32.bfloat16().requires_grad_()
    logprobs, _ = head_logprobs(h, weight, None, targets, 1.0, rows=4)
    got = torch.autograd.grad((logprobs * upstream).sum(), (h, weight))
    # The exact figures: the same bf16 values, everything after them in float32.
    exact_h = h.detach().float().requires_grad_()
    exact_w = weight.detach().float().requires_grad_()
    want_lp = completion_logprobs(F.linear(exact_h, exact_w), targets, 1.0)
    want = torch.autograd.grad((want_lp * upstream).sum(), (exact_h, exact_w))
    torch.testing.assert_close(logprobs, want_lp, rtol=0, atol=5e-2)  # bf16 logits
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16
        assert relative(a.float(), b) <= 2e-2
