"""Loss masks: tokens the policy did not write (a multi-turn trajectory's observations) are
context, never trained, counted or summarised.

A tiny randomly initialised Qwen2 (no Ray, no engine) on a few dozen tokens: the loss and
gradient of a masked trajectory equal those of the same tokens with the observation
spans' loss weights set to zero by hand, and an observation token's id changes the
context of the tokens after it but adds no loss term of its own.
"""

from __future__ import annotations

import copy

import msgspec
import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM

from async_rl.models.tiny_model import build_config
from buffers.common.records import (
    NO_VERSION,
    GroupTokens,
    Prompt,
    Sample,
    TrainSequence,
    make_group,
)
from buffers.common.train_records import LossStats
from workers.trainer.attention import use_packed_attention
from workers.trainer.config import TrainerConfig
from workers.trainer.loss import Normaliser, read_stats, token_loss
from workers.trainer.packing import completion_logprobs, pack, packed_logits, token_entropy
from workers.trainer.ppo_update import StepLoss

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPERATURE = 0.7
# (prompt, completion) lengths and each completion's observation spans (start, stop).
SHAPES = [(4, 12, [(3, 7)]), (6, 20, [(2, 5), (11, 16)]), (3, 6, [])]


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    tiny = Qwen2ForCausalLM(build_config())
    tiny.train()
    assert use_packed_attention(tiny)
    return tiny


def trajectories(seed: int = 3) -> list[TrainSequence]:
    """Multi-turn-like sequences: observation spans with mask 0 and behaviour logprob 0."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, c, spans) in enumerate(SHAPES):
        ids = torch.randint(3, 250, (p + c,), generator=gen).numpy().astype(np.int32)
        behaviour = (-torch.rand(c, generator=gen) * 3).numpy().astype(np.float32)
        mask = np.ones(c, np.int8)
        for a, b in spans:
            mask[a:b] = 0
            behaviour[a:b] = 0.0
        out.append(TrainSequence(prompt_token_ids=ids[:p], completion_token_ids=ids[p:],
                                 behaviour_logprobs=behaviour, advantage=1.5 - i,
                                 loss_mask=None if mask.all() else mask))
    return out


def step_loss(model: torch.nn.Module, config: TrainerConfig, packed: bool = True) -> StepLoss:
    return StepLoss(config=config, model=model, module=model, device=torch.device("cpu"),
                    world_size=1, packed=packed, temperature=TEMPERATURE,
                    max_response_tokens=32)


def run(losses: StepLoss, seqs: list[TrainSequence], norm: Normaliser
        ) -> tuple[torch.Tensor, LossStats, int]:
    """``seqs`` as one micro-batch: (loss, statistics read, positions computed)."""
    (micro_batch,) = losses.prepare([tuple(seqs)])
    loss, stats, positions = losses.micro_batch(micro_batch, norm)
    assert stats is not None
    return loss, read_stats([stats]), positions


def gradient(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def by_hand(model: torch.nn.Module, seqs: list[TrainSequence], config: TrainerConfig
            ) -> torch.Tensor:
    """Every completion token gets a loss term, each weighted by hand: 0 on observations,
    the aggregation's share elsewhere (loss is positively homogeneous in the advantage,
    so a weight c >= 0 on a token's term is its advantage times c)."""
    unmasked = [msgspec.structs.replace(s, loss_mask=None) for s in seqs]
    batch = pack(unmasked)
    logprobs = completion_logprobs(packed_logits(model, batch), batch.targets, TEMPERATURE)
    masks = [np.ones(len(s.completion_token_ids)) if s.loss_mask is None else s.loss_mask
             for s in seqs]
    trained = sum(int(m.sum()) for m in masks)
    if config.loss_agg == "token_mean":
        share = [np.full(len(m), 1.0 / trained) for m in masks]
    else:  # seq_mean_token_mean
        share = [np.full(len(m), 1.0 / (m.sum() * len(seqs))) for m in masks]
    weights = torch.tensor(np.concatenate([m * w for m, w in zip(masks, share, strict=True)]),
                           dtype=torch.float32)
    one = Normaliser(agg="token_mean", tokens=1, sequences=len(seqs))
    loss, _ = token_loss(logprobs, batch.behaviour_logprobs, batch.advantages * weights,
                         lengths=[len(m) for m in masks], norm=one, config=config)
    return loss


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("packed", [True, False])
def test_masked_loss_and_gradient_equal_observation_weights_zeroed_by_hand(
        model: Qwen2ForCausalLM, agg: str, packed: bool) -> None:
    config = TrainerConfig(loss_agg=agg)  # type: ignore[arg-type]
    seqs = trajectories()
    losses = step_loss(model, config, packed)
    [norm], lost = losses.agree([[tuple(seqs)]], lost=False)
    masks = [s.loss_mask for s in seqs if s.loss_mask is not None]
    trained = sum(s.trained_tokens for s in seqs)
    assert len(masks) == 2 and not lost
    assert norm.tokens == trained < sum(c for _, c, _ in SHAPES)  # token_mean counts trained
    loss, stats, positions = run(losses, seqs, norm)
    assert stats.tokens == trained
    assert positions >= sum(p + c for p, c, _ in SHAPES)  # observations are computed
    reference = by_hand(model, seqs, config)
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-7)
    got, want = gradient(model, loss), gradient(model, by_hand(model, seqs, config))
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_statistics_count_trained_tokens_only(model: Qwen2ForCausalLM) -> None:
    seqs = trajectories()
    losses = step_loss(model, TrainerConfig())
    [norm], _ = losses.agree([[tuple(seqs)]], lost=False)
    _, stats, _ = run(losses, seqs, norm)
    full = pack([msgspec.structs.replace(s, loss_mask=None) for s in seqs])
    keep = torch.from_numpy(np.concatenate(
        [np.ones(len(s.completion_token_ids), bool) if s.loss_mask is None
         else s.loss_mask.astype(bool) for s in seqs]))
    with torch.no_grad():
        logits = packed_logits(model, full)
        entropy = token_entropy(logits, TEMPERATURE)
        logprobs = completion_logprobs(logits, full.targets, TEMPERATURE)
        weights = torch.exp(logprobs - full.behaviour_logprobs).clamp(max=2.0)
    assert int(keep.sum()) == stats.tokens < keep.numel()
    assert stats.entropy_sum == pytest.approx(float(entropy[keep].sum()), rel=1e-5)
    assert stats.is_weight_sum == pytest.approx(float(weights[keep].sum()), rel=1e-5)
    assert stats.is_weight_sum != pytest.approx(float(weights.sum()), rel=1e-3)


def test_an_observation_token_changes_the_context_but_adds_no_loss_term(
        model: Qwen2ForCausalLM) -> None:
    seqs = trajectories()
    seq = seqs[1]
    assert seq.loss_mask is not None
    first_obs = int(np.flatnonzero(seq.loss_mask == 0)[0])
    ids = seq.completion_token_ids.copy()
    ids[first_obs] = (ids[first_obs] + 17) % 250 + 3
    changed = [seqs[0], msgspec.structs.replace(seq, completion_token_ids=ids), seqs[2]]
    before, after = pack(seqs), pack(changed)
    # The same loss terms: the changed token is predicted by no position in either.
    assert torch.equal(before.predict_at, after.predict_at)
    assert torch.equal(before.targets, after.targets)
    assert before.input_ids[0].tolist() != after.input_ids[0].tolist()
    with torch.no_grad():
        old = completion_logprobs(packed_logits(model, before), before.targets, TEMPERATURE)
        new = completion_logprobs(packed_logits(model, after), after.targets, TEMPERATURE)
    # Sequence 1's trained tokens after the changed one see another context.
    start = int(seqs[0].trained_tokens)
    head = start + int(seq.loss_mask[:first_obs].sum())
    tail = slice(head, start + seq.trained_tokens)
    assert torch.equal(old[:head], new[:head])
    assert not torch.allclose(old[tail], new[tail])
    assert torch.equal(old[tail.stop:], new[tail.stop:])  # other sequences: untouched


def test_single_turn_samples_carry_no_mask_and_multi_turn_versions_skip_observations(
        ) -> None:
    prompt = Prompt(prompt_id="p", text="1+1", answer="2")
    plain = Sample(token_ids=(5, 6), logprobs=(-0.1, -0.2), versions=(3, 3),
                   finish_reason="stop", text="x")
    assert make_group(prompt, (1,), [plain, plain]).tokens.loss_mask is None
    turns = Sample(token_ids=(5, 9, 9, 6), logprobs=(-0.1, 0.0, 0.0, -0.2),
                   versions=(2, NO_VERSION, NO_VERSION, 3), finish_reason="stop", text="x",
                   loss_mask=(1, 0, 0, 1))
    assert (turns.min_version, turns.max_version) == (2, 3)
    group = make_group(prompt, (1,), [plain, turns])
    assert (group.min_version, group.max_version) == (2, 3)
    tokens: GroupTokens = group.tokens
    assert tokens.loss_mask is not None
    assert tokens.loss_mask.tolist() == [1, 1, 1, 0, 0, 1]
    assert tokens.sequence(0, 1.0).loss_mask is None  # all ones: the single-turn path
    second = tokens.sequence(1, 1.0)
    assert second.loss_mask is not None and second.trained_tokens == 2


def test_packed_and_padded_masked_losses_agree(model: Qwen2ForCausalLM) -> None:
    seqs = trajectories()
    config = TrainerConfig()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    results = []
    for net, packed in ((model, True), (reference, False)):
        losses = step_loss(net, config, packed)
        [norm], _ = losses.agree([[tuple(seqs)]], lost=False)
        results.append(run(losses, seqs, norm)[:2])
    (a, sa), (b, sb) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert sa.tokens == sb.tokens
