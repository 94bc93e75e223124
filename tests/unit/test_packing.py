"""Packed micro-batches: the packed layout, per-sequence attention inside one row, a
trainer step that matches the padded layout it replaced, and steps of several updates
(the proximal pass, epochs, the entropy statistic).

Model-level, but no Ray and no engine: a tiny randomly initialised Qwen2
(``build_config()``, 0.5M parameters) on a few dozen tokens runs in milliseconds.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM

from async_rl.control.step_metrics import _padding_ratio
from async_rl.models.tiny_model import build_config
from buffers.common.records import GroupTokens, TrainSequence
from buffers.common.train_records import LossStats, SequenceSlot, ShardBatch, ShardStepResult
from workers.model_config import ModelConfig
from workers.rollout.config import Sampling
from workers.trainer.attention import PACKED_ATTENTION, use_packed_attention
from workers.trainer.config import TrainerConfig
from workers.trainer.loss import Normaliser, read_stats, token_loss
from workers.trainer.packing import (
    ROWS_AT_ONCE,
    completion_logprobs,
    pack,
    packed_logits,
    packed_logprobs,
    padded_logits,
    padded_logprobs,
    token_entropy,
)
from workers.trainer.ppo_update import StepLoss
from workers.trainer.shard import TrainerShard
from workers.trainer.spec import TrainerSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPERATURE = 0.7
# (prompt, completion) lengths: mixed, so padding would be most of a padded batch.
SHAPES = [(4, 3), (6, 17), (2, 40), (9, 5)]


def sequences(shapes: list[tuple[int, int]] = SHAPES, seed: int = 1) -> list[TrainSequence]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, c) in enumerate(shapes):
        ids = torch.randint(3, 250, (p + c,), generator=gen).tolist()
        behaviour = (-torch.rand(c, generator=gen) * 3).tolist()
        out.append(TrainSequence(prompt_token_ids=np.array(ids[:p], dtype=np.int32),
                                 completion_token_ids=np.array(ids[p:], dtype=np.int32),
                                 behaviour_logprobs=np.array(behaviour, dtype=np.float32),
                                 advantage=i - 1.5))
    return out


def shard_batch(micro_batches: list[list[TrainSequence]], updates: tuple[int, ...] = ()
                ) -> tuple[ShardBatch, list[GroupTokens]]:
    """The micro-batches as a shard receives them: one single-sample group per sequence,
    with the groups' tokens (what the shard would fetch by reference); ``updates`` empty
    is one update of them all."""
    tokens: list[GroupTokens] = []
    slots = []
    for micro_batch in micro_batches:
        row = []
        for seq in micro_batch:
            row.append(SequenceSlot(group=len(tokens), sample=0, advantage=seq.advantage))
            n = len(seq.completion_token_ids)
            tokens.append(GroupTokens(prompt_token_ids=seq.prompt_token_ids,
                                      completion_token_ids=seq.completion_token_ids,
                                      logprobs=seq.behaviour_logprobs,
                                      versions=np.zeros(n, dtype=np.int32),
                                      offsets=np.array([0, n], dtype=np.int64)))
        slots.append(tuple(row))
    return ShardBatch(step=1, groups=tuple(tokens), micro_batches=tuple(slots),
                      updates=updates or (len(slots),)), tokens


@pytest.fixture(scope="module")
def reference() -> Qwen2ForCausalLM:
    """Randomly initialised tiny Qwen2 with transformers' own (sdpa) attention."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(build_config())
    model.train()
    assert model.config._attn_implementation == "sdpa"
    return model


@pytest.fixture(scope="module")
def packed_model(reference: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    model = copy.deepcopy(reference)
    assert use_packed_attention(model)
    assert model.config._attn_implementation == PACKED_ATTENTION
    assert reference.config._attn_implementation == "sdpa"  # the copy switched alone
    return model


def alone(model: torch.nn.Module, seq: TrainSequence) -> torch.Tensor:
    """Completion logprobs of one sequence run by itself: no packing, no padding."""
    ids = torch.tensor([[*seq.prompt_token_ids, *seq.completion_token_ids]])
    logits = model(input_ids=ids, use_cache=False).logits[0].float() / TEMPERATURE
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return logprobs[len(seq.prompt_token_ids) - 1 :]


def test_pack_lays_sequences_end_to_end() -> None:
    seqs = sequences()
    batch = pack(seqs)
    total = sum(p + c for p, c in SHAPES)
    n = sum(c for _, c in SHAPES)
    assert batch.num_tokens == total and batch.input_ids.shape == (1, total)
    assert batch.position_ids.tolist() == [[j for p, c in SHAPES for j in range(p + c)]]
    assert batch.input_ids[0].tolist() == [
        t for s in seqs for t in [*s.prompt_token_ids, *s.completion_token_ids]]
    assert batch.predict_at.shape == batch.targets.shape == (n,)
    assert batch.targets.tolist() == [t for s in seqs for t in s.completion_token_ids]
    assert (batch.input_ids[0, batch.predict_at + 1] == batch.targets).all()
    # Each prediction position lies inside its own sequence, at or after its last prompt token.
    starts = [sum(p + c for p, c in SHAPES[:i]) for i in range(len(SHAPES))]
    expected = [s + p - 1 + j for s, (p, c) in zip(starts, SHAPES, strict=True) for j in range(c)]
    assert batch.predict_at.tolist() == expected
    assert batch.advantages.tolist() == [s.advantage for s in seqs for _ in s.completion_token_ids]
    assert torch.equal(batch.behaviour_logprobs,
                       torch.tensor([x for s in seqs for x in s.behaviour_logprobs]))
    assert batch.behaviour_logprobs.dtype == batch.advantages.dtype == torch.float32


def test_pack_rejects_what_it_cannot_lay_out() -> None:
    with pytest.raises(ValueError, match="empty"):
        pack([])
    (seq,) = sequences([(1, 2)])
    with pytest.raises(ValueError, match="prompt token"):
        pack([TrainSequence(prompt_token_ids=(), completion_token_ids=(5, 6),
                            behaviour_logprobs=(-1.0, -1.0), advantage=0.0)])
    with pytest.raises(ValueError, match="behaviour logprobs"):
        pack([TrainSequence(prompt_token_ids=seq.prompt_token_ids,
                            completion_token_ids=seq.completion_token_ids,
                            behaviour_logprobs=(-1.0,), advantage=0.0)])
    # A completion-less sequence packs (its prompt is computed) and contributes no target.
    empty = TrainSequence(prompt_token_ids=(7, 8), completion_token_ids=(),
                          behaviour_logprobs=(), advantage=1.0)
    batch = pack([empty, seq])
    assert batch.num_tokens == 5 and batch.targets.tolist() == list(seq.completion_token_ids)


@pytest.mark.parametrize("implementation", ["packed", "sdpa", "eager"])
def test_packed_logprobs_equal_each_sequence_run_alone(
    reference: Qwen2ForCausalLM, packed_model: Qwen2ForCausalLM, implementation: str
) -> None:
    # "sdpa"/"eager": transformers' own block-diagonal mask from packed position ids.
    model = packed_model if implementation == "packed" else copy.deepcopy(reference)
    if implementation == "eager":
        model.set_attn_implementation("eager")
    seqs = sequences()
    got = packed_logprobs(model, pack(seqs), TEMPERATURE)
    want = [alone(reference, s) for s in seqs]
    assert [w.numel() for w in want] == [c for _, c in SHAPES]
    assert got.shape == (sum(c for _, c in SHAPES),)
    for part, expected in zip(got.split([c for _, c in SHAPES]), want, strict=True):
        torch.testing.assert_close(part, expected, atol=1e-5, rtol=0)


def test_no_sequence_sees_another(packed_model: Qwen2ForCausalLM) -> None:
    # Changing every token of the first sequence leaves the others' logprobs untouched.
    seqs = sequences()
    head = seqs[0]
    changed = [TrainSequence(prompt_token_ids=tuple(t + 1 for t in head.prompt_token_ids),
                             completion_token_ids=tuple(t + 1 for t in head.completion_token_ids),
                             behaviour_logprobs=head.behaviour_logprobs, advantage=0.0),
               *seqs[1:]]
    first = SHAPES[0][1]
    before = packed_logprobs(packed_model, pack(seqs), TEMPERATURE)
    after = packed_logprobs(packed_model, pack(changed), TEMPERATURE)
    assert not torch.allclose(before[:first], after[:first])
    torch.testing.assert_close(before[first:], after[first:], atol=1e-6, rtol=0)


def loss_and_grads(model: torch.nn.Module, packed: bool) -> tuple[LossStats, list[torch.Tensor]]:
    seqs = sequences()
    model.zero_grad(set_to_none=True)
    if packed:
        batch = pack(seqs)
        logprobs = packed_logprobs(model, batch, TEMPERATURE)
        behaviour, advantages = batch.behaviour_logprobs, batch.advantages
    else:
        logprobs, positions = padded_logprobs(model, seqs, TEMPERATURE)
        assert positions == len(SHAPES) * max(p + c for p, c in SHAPES)
        behaviour = torch.tensor([x for s in seqs for x in s.behaviour_logprobs])
        advantages = torch.tensor([s.advantage for s in seqs for _ in s.completion_token_ids])
    norm = Normaliser(agg="token_mean", tokens=int(logprobs.numel()), sequences=len(seqs))
    loss, stats = token_loss(logprobs, behaviour, advantages, norm=norm, config=TrainerConfig(),
                             lengths=[c for _, c in SHAPES])
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    return read_stats([stats]), [g for g in grads if g is not None]


def test_loss_and_gradients_match_the_padded_layout(
    reference: Qwen2ForCausalLM, packed_model: Qwen2ForCausalLM
) -> None:
    padded_stats, padded_grads = loss_and_grads(reference, packed=False)
    packed_stats, packed_grads = loss_and_grads(packed_model, packed=True)
    assert packed_stats.tokens == padded_stats.tokens == sum(c for _, c in SHAPES)
    assert packed_stats.loss_sum == pytest.approx(padded_stats.loss_sum, rel=1e-5, abs=1e-6)
    assert packed_stats.kl_sum == pytest.approx(padded_stats.kl_sum, rel=1e-5, abs=1e-6)
    assert len(packed_grads) == len(padded_grads) > 0
    for got, want in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


@pytest.fixture(scope="module")
def model_dir(reference: Qwen2ForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packing-model")
    reference.save_pretrained(out)
    return out


def shard(model_dir: Path, packed: bool, compute_dtype: str = "float32",
          **trainer: Any) -> TrainerShard:
    config = msgspec.convert({"max_grad_norm": 1e9, "compute_dtype": compute_dtype,
                              "packed": packed, **trainer}, TrainerConfig)
    trainer = TrainerShard(TrainerSpec(
        rank=0, world_size=1, model=ModelConfig(path=str(model_dir)), trainer=config, seed=0,
        sampling=Sampling(temperature=TEMPERATURE), record_spans=False))
    trainer.setup()
    return trainer


def test_trainer_step_packed_matches_padded_and_reports_padding(model_dir: Path) -> None:
    seqs = sequences()
    # Two micro-batches and an empty pad, as a shard with too few sequences would get.
    batch, tokens = shard_batch([seqs[:2], seqs[2:], []])
    packed, padded = shard(model_dir, packed=True), shard(model_dir, packed=False)
    assert packed.module.config._attn_implementation == PACKED_ATTENTION
    assert padded.module.config._attn_implementation == "sdpa"
    a, b = packed.train_step(batch, tokens), padded.train_step(batch, tokens)
    assert a.loss.tokens == b.loss.tokens == sum(c for _, c in SHAPES)
    assert a.loss.loss_sum == pytest.approx(b.loss.loss_sum, rel=1e-5, abs=1e-6)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    real = sum(p + c for p, c in SHAPES)
    assert a.input_tokens == b.input_tokens == real
    assert a.computed_positions == real and a.padding_ratio == 1.0
    widths = [max(p + c for p, c in SHAPES[:2]), max(p + c for p, c in SHAPES[2:])]
    assert b.computed_positions == 2 * widths[0] + 2 * widths[1]
    assert b.padding_ratio == pytest.approx(b.computed_positions / real) and b.padding_ratio > 1.2
    # The packed model's weights after the step equal the padded one's.
    new_a, new_b = packed.module.state_dict(), padded.module.state_dict()
    for name, value in new_a.items():
        torch.testing.assert_close(value, new_b[name], atol=1e-6, rtol=1e-5)


def test_bfloat16_compute_keeps_float32_state_and_close_loss(model_dir: Path) -> None:
    seqs = sequences()
    batch, tokens = shard_batch([seqs])
    full, half = shard(model_dir, packed=True), shard(model_dir, packed=True,
                                                      compute_dtype="bfloat16")
    before = {k: v.clone() for k, v in half.module.state_dict().items()}
    a, b = full.train_step(batch, tokens), half.train_step(batch, tokens)
    assert a.loss.tokens == b.loss.tokens > 0
    # bf16 matmuls round logprobs to about 3 significant digits: close, not equal.
    assert b.loss.loss_sum == pytest.approx(a.loss.loss_sum, rel=0.05, abs=0.05)
    assert b.loss.loss_sum != a.loss.loss_sum
    after = half.module.state_dict()
    assert len(after) == len(before) > 0
    assert all(value.dtype == torch.float32 for value in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in before)  # it did train


def test_padding_ratio_over_shards() -> None:
    stats = LossStats()

    def result(real: int, computed: int) -> ShardStepResult:
        return ShardStepResult(rank=0, step=1, loss=stats, grad_norm=0.0, forward_s=0.0,
                               backward_s=0.0, optimizer_s=0.0, barrier_s=0.0,
                               input_tokens=real, computed_positions=computed)

    assert result(100, 250).padding_ratio == 2.5
    assert result(0, 0).padding_ratio == 1.0
    assert _padding_ratio([result(100, 100), result(50, 200)]) == 2.0
    assert _padding_ratio([]) == 1.0


# -- entropy and steps of several updates -----------------------------------------------


def test_token_entropy_is_the_entropy_of_the_tempered_distribution() -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(3),
                         requires_grad=True)
    probs = torch.softmax(logits.detach() / TEMPERATURE, dim=-1)
    expected = -(probs * probs.log()).sum(-1)
    got = token_entropy(logits, TEMPERATURE)
    torch.testing.assert_close(got, expected)
    assert not got.requires_grad  # a statistic: nothing kept for backward
    uniform = token_entropy(torch.zeros(2, 8), 1.0)
    torch.testing.assert_close(uniform, torch.full((2,), math.log(8)))


def test_token_entropy_works_through_rows_in_chunks() -> None:
    rows = ROWS_AT_ONCE * 2 + 3  # three chunks, the last one short
    logits = torch.randn(rows, 7, generator=torch.Generator().manual_seed(4))
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    got = token_entropy(logits, TEMPERATURE)
    assert got.shape == (rows,)
    torch.testing.assert_close(got, -(probs * probs.log()).sum(-1))
    assert token_entropy(torch.zeros(0, 7), 1.0).shape == (0,)


def test_packed_and_padded_logits_agree(
    reference: Qwen2ForCausalLM, packed_model: Qwen2ForCausalLM
) -> None:
    seqs = sequences()
    packed = packed_logits(packed_model, pack(seqs))
    padded, targets, _ = padded_logits(reference, seqs)
    assert targets.tolist() == [t for s in seqs for t in s.completion_token_ids]
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(token_entropy(packed, TEMPERATURE),
                               token_entropy(padded, TEMPERATURE), atol=1e-5, rtol=1e-5)


def test_the_proximal_pass_reproduces_the_current_policy(model_dir: Path) -> None:
    # So with proximal logprobs the first update's loss and gradient are the single-update
    # ones (r = 1 exactly).
    trainer = shard(model_dir, packed=True)
    micro_batch = tuple(sequences())
    prepared = trainer.losses.prepare([micro_batch])
    (proximal,) = trainer.losses.proximal(prepared)
    assert proximal is not None and not proximal.requires_grad
    assert torch.equal(proximal, packed_logprobs(trainer.module, pack(micro_batch),
                                                 TEMPERATURE).detach())
    norm = Normaliser(agg="token_mean", tokens=proximal.numel(), sequences=len(micro_batch))
    results = []
    for prox in (None, proximal):
        trainer.optimizer.zero_grad(set_to_none=True)
        loss, stats, _ = trainer.losses.micro_batch(prepared[0], norm, prox)
        loss.backward()
        assert stats is not None
        results.append((loss.detach(), read_stats([stats]), [p.grad.clone() for p in
                                               trainer.module.parameters()
                                               if p.grad is not None]))
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and stats_a == stats_b
    assert stats_a.entropy_sum > 0
    assert len(grads_a) == len(grads_b) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def counting_proximal(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = StepLoss.proximal

    def proximal(self: StepLoss, micro_batches: Any) -> Any:
        calls.append(len(micro_batches))
        return original(self, micro_batches)

    monkeypatch.setattr(StepLoss, "proximal", proximal)
    return calls


def test_a_single_update_step_makes_no_proximal_pass(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = counting_proximal(monkeypatch)
    seqs = sequences()
    batch, tokens = shard_batch([seqs[:2], seqs[2:]])
    result = shard(model_dir, packed=True).train_step(batch, tokens)
    assert calls == []
    assert result.loss.tokens == sum(c for _, c in SHAPES)


def test_several_updates_train_every_token_once_per_epoch(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = counting_proximal(monkeypatch)
    seqs = sequences()
    batch, tokens = shard_batch([seqs[:2], seqs[2:], []], updates=(1, 2))
    single, _ = shard_batch([seqs[:2], seqs[2:], []])
    once = shard(model_dir, packed=True)
    twice = shard(model_dir, packed=True, mini_batches=2, epochs=2)
    before = {k: v.clone() for k, v in twice.module.state_dict().items()}
    a = once.train_step(single, tokens)
    b = twice.train_step(batch, tokens)
    assert calls == [3]  # one no-grad pass over the step's micro-batches, before any update
    n = sum(c for _, c in SHAPES)
    assert b.loss.tokens == 2 * n and a.loss.tokens == n
    assert b.computed_positions == a.computed_positions == a.input_tokens  # one pass counted
    assert math.isfinite(b.grad_norm) and not b.nonfinite
    assert 0 < b.loss.entropy_sum / b.loss.tokens <= math.log(build_config().vocab_size)
    after_a, after_b = once.module.state_dict(), twice.module.state_dict()
    # Four updates move the weights further than one.
    moved_a = sum(float((after_a[k] - before[k]).norm()) for k in before)
    moved_b = sum(float((after_b[k] - before[k]).norm()) for k in before)
    assert moved_b > 2 * moved_a > 0


def test_logprobs_in_chunks_equal_one_pass_in_value_and_gradient() -> None:
    rows = 2 * 5 + 3  # three chunks of 5, the last one short
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, 11, generator=gen, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 11, (rows,), generator=gen)
    weights = torch.randn(rows, generator=gen)
    whole = completion_logprobs(logits, targets, TEMPERATURE, rows=rows)
    (grad_whole,) = torch.autograd.grad((whole * weights).sum(), logits)
    chunked = completion_logprobs(logits, targets, TEMPERATURE, rows=5)
    (grad_chunked,) = torch.autograd.grad((chunked * weights).sum(), logits)
    assert chunked.dtype == torch.float32 and chunked.shape == (rows,)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)
    torch.testing.assert_close(grad_chunked, grad_whole, rtol=0, atol=0)
    expected = torch.log_softmax(logits.detach().float() / TEMPERATURE, -1)[
        torch.arange(rows), targets]
    torch.testing.assert_close(chunked.detach(), expected)
    with torch.no_grad():
        torch.testing.assert_close(completion_logprobs(logits, targets, TEMPERATURE, rows=5),
                                   whole.detach(), rtol=0, atol=0)
    assert completion_logprobs(torch.zeros(0, 11), targets[:0], 1.0).shape == (0,)
