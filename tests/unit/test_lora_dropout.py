"""model.lora.dropout > 0 on a trainer shard: the no-grad passes whose logprobs stand for
a policy (the proximal pass, the KL in the reward's) run without dropout, so two of them
agree and the behaviour weight of a one-update step carries no dropout mask; the
gradient pass keeps its dropout, and the model is back in train mode after."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_lora import tiny
from test_ppo_roles import GROUPS

from buffers.plan.batching import shard_batches
from workers.model_config import LoraConfig, ModelConfig
from workers.rollout.config import Sampling
from workers.trainer.config import TrainerConfig
from workers.trainer.ppo_update import Prepared
from workers.trainer.shard import TrainerShard
from workers.trainer.spec import TrainerSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = TrainerConfig(groups_per_step=2, lr=1e-3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny(tmp_path_factory.mktemp("lora-dropout"))


def lora_shard(model_dir: Path, dropout: float) -> TrainerShard:
    """A shard with LoRA at ``dropout``, its adapters' B drawn (fresh, B = 0: the
    adapters, and so their dropout, would change nothing)."""
    out = TrainerShard(TrainerSpec(
        rank=0, world_size=1, trainer=CONFIG, seed=0,
        model=ModelConfig(path=str(model_dir), lora=LoraConfig(
            rank=4, dropout=dropout, target_modules=("q_proj", "up_proj"))),
        sampling=Sampling(temperature=1.0), record_spans=False))
    out.setup()
    draws = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in out.module.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=draws))
    return out


def laid_out(shard: TrainerShard) -> list[Prepared]:
    (batch,), _ = shard_batches(GROUPS, 1, CONFIG, step=1)
    return shard.losses.prepare(batch.sequences(list(batch.groups)))


def test_two_proximal_passes_with_lora_dropout_give_the_same_logprobs(model_dir: Path) -> None:
    shard = lora_shard(model_dir, dropout=0.3)
    prepared = laid_out(shard)
    first, second = shard.losses.proximal(prepared), shard.losses.proximal(prepared)
    pairs = [(a, b) for a, b in zip(first, second, strict=True) if a is not None]
    assert len(pairs) == len(prepared) > 0
    assert all(torch.equal(a, b) for a, b in pairs)
    # The model's own mode is back: the gradient pass still draws its masks.
    assert all(m.training for m in shard.module.modules())
    mb = next(m for m in prepared if m.packed is not None)
    with torch.no_grad():
        drawn = [shard.losses.forward(shard.model, mb).logprobs for _ in range(2)]
    assert not torch.equal(drawn[0], drawn[1])


def test_without_dropout_the_proximal_pass_is_the_gradient_pass(model_dir: Path) -> None:
    shard = lora_shard(model_dir, dropout=0.0)
    assert not shard.losses.dropout and not shard.losses.needs_proximal(1)
    assert lora_shard(model_dir, dropout=0.3).losses.needs_proximal(1)
    prepared = laid_out(shard)
    mb = next(m for m in prepared if m.packed is not None)
    with torch.no_grad():
        grad_pass = shard.losses.forward(shard.model, mb).logprobs
    (proximal, *_) = [p for p in shard.losses.proximal(prepared) if p is not None]
    assert torch.equal(proximal, grad_pass)


def test_a_one_update_step_with_dropout_weighs_by_the_policy_without_dropout(
        model_dir: Path) -> None:
    """The behaviour weight min(pi_prox / pi_behaviour, tis_cap) of a one-update step is
    the policy's at the step's start, computed without dropout, not the gradient pass's
    (under a mask)."""
    shard = lora_shard(model_dir, dropout=0.3)
    prepared = laid_out(shard)
    shard.module.eval()  # the policy itself: no mask
    with torch.no_grad():
        proximal = torch.cat([shard.losses.forward(shard.module, mb).logprobs
                              for mb in prepared if mb.packed is not None])
    shard.module.train()
    behaviour = torch.cat([mb.packed.behaviour_logprobs for mb in prepared
                           if mb.packed is not None])
    want = torch.exp(proximal - behaviour).clamp(max=CONFIG.tis_cap)
    (batch,), _ = shard_batches(GROUPS, 1, CONFIG, step=1)
    result = shard.train_step(batch, list(batch.groups))
    assert result.loss.tokens == want.numel() > 0
    assert result.loss.is_weight_sum == pytest.approx(float(want.double().sum()), rel=1e-6)
    assert result.loss.is_weight_max == pytest.approx(float(want.max()), rel=1e-6)
