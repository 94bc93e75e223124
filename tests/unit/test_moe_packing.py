"""Mixture-of-experts policies under packing: the routers see only real tokens, and the
router load-balancing loss (``trainer.router_aux_coef``) is off by default, and when on
adds the model's own auxiliary loss, with its gradient, and its statistic.

The models are ``async_rl.models.families``' tiny random ones (4 experts, top 2).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from test_packing import TEMPERATURE, sequences, shard, shard_batch
from transformers import AutoModelForCausalLM

from async_rl.control.loss_stats import merge_stats, summarise
from async_rl.models.families import build_family_model, tiny_config
from async_rl.run.inputs import check_router
from buffers.common.config import ConfigError
from buffers.common.records import TrainSequence
from workers.trainer import ppo_update
from workers.trainer.attention import use_packed_attention
from workers.trainer.config import TrainerConfig
from workers.trainer.loss import Normaliser, read_stats
from workers.trainer.packing import pack, packed_forward
from workers.trainer.ppo_update import StepLoss

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MOE = ("qwen3_moe", "mixtral", "olmoe", "granitemoe", "gpt_oss", "qwen3_next")
SHAPES = [(4, 3), (6, 17), (2, 30), (9, 5), (1, 1)]


def moe_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).train()


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


@pytest.mark.parametrize("arch", MOE)
def test_the_routers_see_only_the_real_tokens_of_a_packed_row(arch: str) -> None:
    model = moe_model(arch)
    use_packed_attention(model)
    seen: list[int] = []
    layers = routers(model)
    assert len(layers) == tiny_config(arch).num_hidden_layers
    hooks = [r.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
        for r in layers]
    seqs = sequences(SHAPES)
    with torch.no_grad():
        packed_forward(model, model, pack(seqs), TEMPERATURE)
        real = sum(p + c for p, c in SHAPES)
        assert seen == [real] * len(layers)  # no padding: every routed token is real
        seen.clear()
        (one,) = sequences([(1, 1)])
        packed_forward(model, model, pack([one]), TEMPERATURE)
        assert seen == [2] * len(layers)
    for hook in hooks:
        hook.remove()


# -- trainer.router_aux_coef ----------------------------------------------------------------


def step_loss(model: torch.nn.Module, coef: float) -> StepLoss:
    config = TrainerConfig(router_aux_coef=coef)
    return StepLoss(config=config, model=model, module=model, device=torch.device("cpu"),
                    world_size=1, packed=True, temperature=TEMPERATURE,
                    max_response_tokens=32)


def padded_aux(model: torch.nn.Module, seqs: list[TrainSequence]) -> torch.Tensor:
    """The model's own load-balancing loss over the real tokens of a right-padded batch
    (its attention mask leaves the pads out)."""
    lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in seqs]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, :lengths[row]] = torch.from_numpy(np.concatenate(
            [s.prompt_token_ids, s.completion_token_ids]).astype(np.int64))
        mask[row, :lengths[row]] = 1
    aux: torch.Tensor = model(input_ids=ids, attention_mask=mask, use_cache=False,
                              output_router_logits=True).aux_loss
    return aux


def router_grad(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([r.weight.grad.flatten() for r in routers(model)])


def test_router_aux_coef_defaults_to_0_and_then_computes_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert TrainerConfig().router_aux_coef == 0.0

    def refused(*args: object) -> None:
        raise AssertionError("the router loss was computed with trainer.router_aux_coef = 0")

    monkeypatch.setattr(ppo_update, "packed_forward_router_aux", refused)
    model = moe_model("qwen3_moe")
    use_packed_attention(model)
    seqs = sequences(SHAPES)
    tokens = sum(c for _, c in SHAPES)
    losses = step_loss(model, 0.0)
    (micro_batch,) = losses.prepare([tuple(seqs)])
    norm = Normaliser(agg="token_mean", tokens=tokens, sequences=len(seqs))
    loss, stats, _ = losses.micro_batch(micro_batch, norm)
    assert stats is not None
    read = read_stats([stats])
    assert read.router_aux_sum == 0.0 and "router_aux" not in summarise(read)
    # The loss is the policy loss alone (with one update its value is -sum(w * A) / N).
    assert float(loss.detach()) == pytest.approx(read.loss_sum / tokens, rel=1e-6)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_router_aux_coef_adds_the_models_own_load_balancing_loss(arch: str) -> None:
    model = moe_model(arch)
    use_packed_attention(model)
    seqs = sequences(SHAPES)
    tokens = sum(c for _, c in SHAPES)
    coef = 0.5
    without, with_aux = step_loss(model, 0.0), step_loss(model, coef)
    (micro_batch,) = without.prepare([tuple(seqs)])
    # The micro-batch is half the update's tokens: its aux loss weighs half.
    norm = Normaliser(agg="token_mean", tokens=2 * tokens, sequences=2 * len(seqs))
    base, _, _ = without.micro_batch(micro_batch, norm)
    loss, stats, _ = with_aux.micro_batch(micro_batch, norm)
    assert stats is not None
    aux = padded_aux(model, seqs).detach()
    assert float(aux) > 0
    assert float((loss - base).detach()) == pytest.approx(coef * 0.5 * float(aux), rel=1e-5)
    read = read_stats([stats])
    assert read.router_aux_sum == pytest.approx(float(aux) * tokens, rel=1e-5)
    assert summarise(merge_stats([read]))["router_aux"] == pytest.approx(float(aux), rel=1e-5)
    # The gradient reaches the routers: coef/2 times the aux loss's own gradient more.
    grad_base = router_grad(model, base)
    grad = router_grad(model, with_aux.micro_batch(micro_batch, norm)[0])
    grad_aux = router_grad(model, padded_aux(model, seqs))
    assert float(grad_aux.norm()) > 0
    torch.testing.assert_close(grad - grad_base, coef * 0.5 * grad_aux, rtol=1e-4, atol=1e-7)


def test_a_step_with_router_aux_coef_logs_router_aux(tmp_path: Path) -> None:
    model_dir = build_family_model("qwen3_moe", tmp_path / "moe")
    seqs = sequences(SHAPES)
    batch, tokens = shard_batch([seqs[:2], seqs[2:]])
    on = shard(model_dir, packed=True, router_aux_coef=0.01).train_step(batch, tokens)
    off = shard(model_dir, packed=True).train_step(batch, tokens)
    assert on.loss.tokens == off.loss.tokens == sum(c for _, c in SHAPES)
    assert off.loss.router_aux_sum == 0.0 and "router_aux" not in summarise(off.loss)
    # Each micro-batch's value is at least 1 (num_experts * sum f_i P_i, Switch's
    # minimum at an even load), and the loss it adds is coef times it.
    assert summarise(on.loss)["router_aux"] >= 1.0 - 1e-6
    assert on.loss.loss_sum == pytest.approx(off.loss.loss_sum, rel=1e-5)
    assert on.grad_norm != pytest.approx(off.grad_norm, rel=1e-6)


def test_router_aux_coef_needs_the_packed_layout_and_a_model_with_routers(
        tmp_path: Path) -> None:
    with pytest.raises(msgspec.ValidationError, match=r"trainer.router_aux_coef = 0.1: needs"):
        msgspec.convert({"router_aux_coef": 0.1, "packed": False}, TrainerConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"router_aux_coef": -0.1}, TrainerConfig)
    tiny_config("qwen3_moe").save_pretrained(tmp_path / "moe")
    check_router(str(tmp_path / "moe"), 0.1)
    tiny_config("llama").save_pretrained(tmp_path / "dense")
    with pytest.raises(ConfigError) as info:
        check_router(str(tmp_path / "dense"), 0.1)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("config error: trainer.router_aux_coef = 0.1: ")
    assert "(llama) has no mixture-of-experts routers" in message
