"""Padding-free micro-batches: one packed row per micro-batch, attention kept per sequence.

Owns: laying a micro-batch's sequences end to end in one row (``pack``; only trained
completion tokens, loss mask 1, are predicted: ``trained_positions``), the attention
function that keeps each sequence to itself inside that row (``packed_attention``), and
the completion-token logits and logprobs of a packed forward (``packed_logits``,
``packed_logprobs``) and their entropy (``token_entropy``). The padded layout the
trainer used before (``padded_logits``, ``padded_logprobs``) stays as the reference the tests
and ``bench/packing.py`` compare against. Knows nothing about Ray, DDP, optimizers or the
GRPO loss.

Why a custom attention function: transformers (5.x) turns packed ``position_ids`` into a
block-diagonal mask by itself when no attention mask and no cache is passed (note
``use_cache=False``: with the config default a fresh cache is made and the model
silently falls back to one causal mask over the whole row). That mask is dense, so SDPA
still computes (and masks away) every query-key pair of the row: ``T^2`` for a row of
``T`` tokens instead of ``sum(L^2)`` over its sequences, which at a 2048-token cap costs
more than the padding it saves. ``packed_attention`` runs causal SDPA on each sequence's
slice instead, with no mask at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from buffers.records import TrainSequence

PACKED_ATTENTION = "async_rl_packed_sdpa"
"""Name under which ``packed_attention`` is registered with transformers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedBatch:
    """One micro-batch as a single packed row plus where its completion tokens are."""

    input_ids: torch.Tensor
    """``(1, T)``: every sequence's prompt then completion, end to end."""
    position_ids: torch.Tensor
    """``(1, T)``: restarting at 0 at each sequence's first token."""
    predict_at: torch.Tensor
    """``(N,)``: the packed position whose logits predict each completion token (the
    token's own position - 1, always inside its sequence)."""
    targets: torch.Tensor
    """``(N,)``: the completion token ids, in sequence order."""
    behaviour_logprobs: torch.Tensor
    """``(N,)`` float32: the rollout engine's logprob of each completion token."""
    advantages: torch.Tensor
    """``(N,)`` float32: each completion token's sequence advantage."""

    # N counts the trained completion tokens only: a token with loss mask 0 (an
    # observation) is in ``input_ids`` as context, but nothing predicts it.

    @property
    def num_tokens(self) -> int:
        """Real tokens in the row (= positions the model computes: no padding)."""
        return int(self.input_ids.shape[1])


def trained_positions(sequences: Sequence[TrainSequence]) -> torch.Tensor | None:
    """Which of the sequences' completion tokens (end to end) are trained, as a bool
    tensor; None when all are (no sequence has a loss mask)."""
    if all(s.loss_mask is None for s in sequences):
        return None
    return torch.from_numpy(np.concatenate([
        np.ones(len(s.completion_token_ids), bool) if s.loss_mask is None
        else s.loss_mask.astype(bool) for s in sequences]))


def pack(sequences: Sequence[TrainSequence], device: torch.device | str = "cpu") -> PackedBatch:
    """Lays ``sequences`` end to end; every tensor is built whole, no per-token loop.

    Only trained completion tokens (loss mask 1) are predicted: the others stay in the
    row as context for the tokens after them."""
    if not sequences:
        raise ValueError("cannot pack an empty micro-batch")
    if any(len(s.prompt_token_ids) == 0 for s in sequences):
        # Completion token 0 is predicted from the prompt's last position.
        raise ValueError("every sequence needs at least one prompt token")
    prompt = torch.tensor([len(s.prompt_token_ids) for s in sequences])
    completion = torch.tensor([len(s.completion_token_ids) for s in sequences])
    length = prompt + completion
    start = torch.cumsum(length, 0) - length
    ids = torch.from_numpy(np.concatenate(
        [part for s in sequences for part in (s.prompt_token_ids, s.completion_token_ids)]
    ).astype(np.int64))
    total = int(length.sum())
    positions = torch.arange(total) - torch.repeat_interleave(start, length)
    # Completion token j of sequence i sits at start_i + prompt_i + j; predicted one before.
    n = int(completion.sum())
    first = torch.repeat_interleave(start + prompt - 1, completion)
    within = torch.arange(n) - torch.repeat_interleave(torch.cumsum(completion, 0) - completion,
                                                       completion)
    predict_at = first + within
    behaviour = torch.from_numpy(
        np.concatenate([s.behaviour_logprobs for s in sequences]).astype(np.float32))
    if behaviour.numel() != n:
        raise ValueError(f"{behaviour.numel()} behaviour logprobs for {n} completion tokens")
    advantages = torch.repeat_interleave(
        torch.tensor([s.advantage for s in sequences], dtype=torch.float32), completion)
    keep = trained_positions(sequences)
    if keep is not None:
        predict_at, behaviour, advantages = predict_at[keep], behaviour[keep], advantages[keep]
    return PackedBatch(
        input_ids=ids.unsqueeze(0).to(device),
        position_ids=positions.unsqueeze(0).to(device),
        predict_at=predict_at.to(device),
        targets=ids[predict_at + 1].to(device),
        behaviour_logprobs=behaviour.to(device),
        advantages=advantages.to(device),
    )


def _segment_lengths(positions: torch.Tensor) -> list[int]:
    """Lengths of the sequences in one packed row: a new one starts where position is 0."""
    starts = torch.nonzero(positions == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return [b - a for a, b in itertools.pairwise([*starts, positions.numel()])]


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: causal SDPA within each packed sequence.

    ``query`` is ``(B, heads, T, d)``, ``key``/``value`` ``(B, kv_heads, T, d)``;
    sequences are found from ``position_ids`` (a new one wherever it is 0). Never
    builds a mask: each sequence's slice is a plain causal SDPA (grouped-query heads
    included), so the work is ``sum(L^2)``, not ``T^2``.
    """
    if sliding_window is not None:
        raise ValueError("packed attention takes no sliding window (Qwen2 here has none)")
    if key.shape[2] != query.shape[2]:
        raise ValueError("packed attention is for training: it takes no KV cache")
    gqa = key.shape[1] != query.shape[1]
    dropout_p = dropout if module.training else 0.0
    rows = []
    for b in range(query.shape[0]):
        lengths = ([query.shape[2]] if position_ids is None
                   else _segment_lengths(position_ids[min(b, position_ids.shape[0] - 1)]))
        parts = [
            F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                           scale=scaling, enable_gqa=gqa)
            for q, k, v in zip(query[b : b + 1].split(lengths, 2), key[b : b + 1].split(lengths, 2),
                               value[b : b + 1].split(lengths, 2), strict=True)
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, 2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, 0)
    return out.transpose(1, 2).contiguous(), None


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switches a transformers model to ``packed_attention``; False if it cannot switch.

    Either way ``packed_logprobs`` stays correct: without the switch transformers builds
    the (dense) block-diagonal mask from the packed position ids itself.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        return False
    setter(PACKED_ATTENTION)
    return getattr(model.config, "_attn_implementation", None) == PACKED_ATTENTION


ROWS_AT_ONCE = 1024
"""Rows of logits ``completion_logprobs`` and ``token_entropy`` work on at once: their
float32 temporaries are ``ROWS_AT_ONCE x V``, not ``N x V`` (at 16k completion tokens
and a 150k vocabulary that would be 10 GB a micro-batch)."""


def _rows_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def completion_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float,
    rows: int = ROWS_AT_ONCE,
) -> torch.Tensor:
    """``log softmax(logits / temperature)[target]`` per row of ``(N, V)`` logits.

    Computed ``rows`` at a time. With gradient each chunk is checkpointed: backward
    recomputes its float32 softmax instead of keeping one for every row, so no float32
    copy of the whole micro-batch's logits is ever held (the logits themselves are the
    LM head's output, in its dtype: bf16 under trainer.compute_dtype = "bfloat16").
    """
    chunks = zip(logits.split(rows), targets.split(rows), strict=True)
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return torch.cat([_rows_logprobs(x, t, temperature) for x, t in chunks])
    return torch.cat([checkpoint(_rows_logprobs, x, t, temperature, use_reentrant=False)
                      for x, t in chunks])


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per row of ``(N, V)`` logits, without
    gradient (a statistic: the graph keeps nothing vocabulary-sized for it)."""
    with torch.no_grad():
        parts = []
        for rows in logits.split(ROWS_AT_ONCE):
            rows = rows.float()
            if temperature != 1.0:
                rows = rows / temperature
            logp = torch.log_softmax(rows, dim=-1)
            parts.append(-(logp.exp() * logp).sum(-1))
        return torch.cat(parts)


def packed_logits(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """``(N, V)`` logits predicting each completion token of a packed micro-batch.

    The LM head runs only on the positions that predict a completion token
    (``logits_to_keep``), so prompt positions never become vocabulary-sized rows.
    """
    logits = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,  # a cache would hide the packing from transformers' own masks
        logits_to_keep=batch.predict_at,
    ).logits
    return logits[0]


def packed_logprobs(
    model: torch.nn.Module, batch: PackedBatch, temperature: float
) -> torch.Tensor:
    """Current-policy logprob of every completion token of a packed micro-batch."""
    return completion_logprobs(packed_logits(model, batch), batch.targets, temperature)


def padded_logits(
    model: torch.nn.Module,
    sequences: Sequence[TrainSequence],
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The padded reference: one right-padded row per sequence; (``(N, V)`` logits
    predicting each trained completion token, the N targets, positions computed).

    Same values as ``packed_logits`` on a model with standard attention; positions
    computed are rows x longest row.
    """
    lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in sequences]
    width = max(lengths)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : lengths[row]] = torch.from_numpy(
            np.concatenate([seq.prompt_token_ids, seq.completion_token_ids]).astype(np.int64))
        mask[row, : lengths[row]] = 1
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    # Completion token j of row i sits at prompt_i + j; predicted one position before.
    spans = [slice(len(s.prompt_token_ids) - 1, lengths[row] - 1)
             for row, s in enumerate(sequences)]
    picked = torch.cat([logits[row, span] for row, span in enumerate(spans)])
    targets = torch.cat([ids[row, span.start + 1 : span.stop + 1]
                         for row, span in enumerate(spans)])
    keep = trained_positions(sequences)
    if keep is not None:
        keep = keep.to(picked.device)
        picked, targets = picked[keep], targets[keep]
    return picked, targets, ids.numel()


def padded_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[TrainSequence],
    temperature: float,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, int]:
    """``padded_logits`` as completion logprobs; (logprobs, positions computed)."""
    logits, targets, positions = padded_logits(model, sequences, device)
    return completion_logprobs(logits, targets, temperature), positions
