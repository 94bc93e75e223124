"""Padding-free micro-batches: one packed row per micro-batch, attention kept per sequence.

Owns: laying a micro-batch's sequences end to end in one row (``pack``: every index and
offset computed once on the host, the tensors sent to the device in one copy that does
not make the host wait, ``to_device``; only
trained completion tokens, loss mask 1, are predicted: ``trained_positions``), the
packed forward that returns each completion token's logprob and entropy through the
fused LM head (``packed_forward``, ``packed_logprobs``; with a mixture-of-experts
model's router load-balancing loss too, ``packed_forward_router_aux``;
``workers.trainer.attention`` keeps each sequence to itself, ``workers.trainer.lm_head``
never builds the full logits), and the full-logits routes kept as references
(``packed_logits``, and the padded layout the trainer used before, ``padded_logits``,
``padded_logprobs``, with ``completion_logprobs`` and ``token_entropy`` over logits)
that the tests and ``bench/trainer/trainer_step.py`` compare against. Knows nothing about Ray,
DDP, optimizers or the GRPO loss.

``use_cache=False`` on every forward: with the config default a fresh cache is made and
the model silently falls back to one causal mask over the whole row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from buffers.common.records import TrainSequence
from workers.trainer.attention import attention_kwargs
from workers.trainer.head_transform import head_transform
from workers.trainer.lm_head import head_logprobs


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedBatch:
    """One micro-batch as a single packed row plus where its completion tokens are.

    Tensors live on the device; ``lengths``, ``max_len`` and ``cu_seqlens_host`` are the
    same offsets on the host, so nothing that splits the row reads the device."""

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
    cu_seqlens: torch.Tensor
    """``(S + 1,)`` int32 on the device: where each sequence starts, then ``T``."""
    cu_seqlens_host: torch.Tensor
    """``cu_seqlens`` on the host (the same tensor on a CPU device)."""
    lengths: tuple[int, ...]
    """Each sequence's tokens (prompt and completion)."""
    max_len: int
    """The longest sequence's tokens."""

    # N counts the trained completion tokens only: a token with loss mask 0 (an
    # observation) is in ``input_ids`` as context, but nothing predicts it.

    @property
    def num_tokens(self) -> int:
        """Real tokens in the row (= positions the model computes: no padding)."""
        return int(self.input_ids.shape[1])


def _trained_mask(sequences: Sequence[TrainSequence]) -> np.ndarray | None:
    if all(s.loss_mask is None for s in sequences):
        return None
    return np.concatenate([
        np.ones(len(s.completion_token_ids), bool) if s.loss_mask is None
        else s.loss_mask.astype(bool) for s in sequences])


def trained_positions(sequences: Sequence[TrainSequence]) -> torch.Tensor | None:
    """Which of the sequences' completion tokens (end to end) are trained, as a bool
    tensor; None when all are (no sequence has a loss mask)."""
    keep = _trained_mask(sequences)
    return None if keep is None else torch.from_numpy(keep)


def to_device(parts: Sequence[torch.Tensor], device: torch.device
              ) -> list[torch.Tensor]:
    """Host tensors ``parts`` on ``device`` in one host-to-device copy that does not make
    the host wait (``torch.tensor(..., device=...)`` would: a blocking copy from pageable
    memory waits for the stream); on the CPU as they are."""
    return list(parts) if device.type == "cpu" else _through_one_buffer(parts, device)


def _through_one_buffer(parts: Sequence[torch.Tensor], device: torch.device
                        ) -> list[torch.Tensor]:
    """``parts`` copied to ``device`` at once: their bytes laid end to end (8-byte
    dtypes first, so every part stays aligned), pinned on CUDA, sent without blocking
    the host, then viewed back."""
    flat = torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])
    if device.type == "cuda":
        flat = flat.pin_memory()
    sent = flat.to(device, non_blocking=True)
    out, offset = [], 0
    for p in parts:
        size = p.numel() * p.element_size()
        out.append(sent[offset:offset + size].view(p.dtype).view(p.shape))
        offset += size
    return out


def pack(sequences: Sequence[TrainSequence], device: torch.device | str = "cpu") -> PackedBatch:
    """Lays ``sequences`` end to end; every index is computed whole on the host (numpy),
    with no per-token loop, and the tensors reach ``device`` in one copy.

    Only trained completion tokens (loss mask 1) are predicted: the others stay in the
    row as context for the tokens after them."""
    if not sequences:
        raise ValueError("cannot pack an empty micro-batch")
    if any(len(s.prompt_token_ids) == 0 for s in sequences):
        # Completion token 0 is predicted from the prompt's last position.
        raise ValueError("every sequence needs at least one prompt token")
    prompt = np.array([len(s.prompt_token_ids) for s in sequences], np.int64)
    completion = np.array([len(s.completion_token_ids) for s in sequences], np.int64)
    length = prompt + completion
    cu = np.concatenate([[0], np.cumsum(length)])
    start = cu[:-1]
    ids = np.concatenate(
        [part for s in sequences for part in (s.prompt_token_ids, s.completion_token_ids)]
    ).astype(np.int64)
    positions = np.arange(int(cu[-1])) - np.repeat(start, length)
    # Completion token j of sequence i sits at start_i + prompt_i + j; predicted one before.
    n = int(completion.sum())
    within = np.arange(n) - np.repeat(np.cumsum(completion) - completion, completion)
    predict_at = np.repeat(start + prompt - 1, completion) + within
    behaviour = np.concatenate([s.behaviour_logprobs for s in sequences]).astype(np.float32)
    if behaviour.size != n:
        raise ValueError(f"{behaviour.size} behaviour logprobs for {n} completion tokens")
    advantages = np.repeat(np.array([s.advantage for s in sequences], np.float32), completion)
    keep = _trained_mask(sequences)
    if keep is not None:
        predict_at, behaviour, advantages = predict_at[keep], behaviour[keep], advantages[keep]
    cu_host = torch.from_numpy(cu.astype(np.int32))
    host = [torch.from_numpy(a) for a in (ids[None], positions[None], predict_at,
                                          ids[predict_at + 1])]
    host += [cu_host, torch.from_numpy(behaviour), torch.from_numpy(advantages)]
    on_device = to_device(host, torch.device(device))
    input_ids, position_ids, predict, targets, cu_seqlens, behaviour_t, advantages_t = on_device
    return PackedBatch(
        input_ids=input_ids, position_ids=position_ids, predict_at=predict, targets=targets,
        behaviour_logprobs=behaviour_t, advantages=advantages_t, cu_seqlens=cu_seqlens,
        cu_seqlens_host=cu_host, lengths=tuple(int(x) for x in length),
        max_len=int(length.max()),
    )


def _run(model: torch.nn.Module, batch: PackedBatch, keep: torch.Tensor, **extra: Any
         ) -> Any:
    return model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,  # a cache would hide the packing from the attention
        logits_to_keep=keep,
        **attention_kwargs(batch.cu_seqlens, batch.max_len, batch.lengths),
        **extra,
    )


def _final_hidden(model: torch.nn.Module, module: torch.nn.Module, batch: PackedBatch,
                  **extra: Any) -> tuple[torch.Tensor, Any]:
    """``(1, T, hidden)``: the decoder's output (after its final norm) in a forward of
    ``model`` whose own head runs on no row, and that forward's output (``extra``: more
    keyword arguments for it).

    Taken by a forward hook on the decoder for this one call. Not
    ``output_hidden_states``: that installs transformers' output-capturing hooks on
    every attention module for good, and their context-variable read breaks a compiled
    layer's graph in two."""
    captured: list[torch.Tensor] = []
    decoder = module.get_decoder()  # type: ignore[operator]
    handle = decoder.register_forward_hook(
        lambda _module, _args, output: captured.append(output.last_hidden_state))
    try:
        output = _run(model, batch, batch.predict_at[:0], **extra)
    finally:
        handle.remove()
    (hidden,) = captured
    return hidden, output


def _head(module: torch.nn.Module, batch: PackedBatch, hidden: torch.Tensor,
          temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``head_logprobs`` of the completion tokens from the row's final hidden states,
    with the head's own logit transform."""
    head = module.get_output_embeddings()  # type: ignore[operator]
    if hasattr(head, "base_layer"):
        # An adapter on the head: the fused head would read its base weight only.
        raise ValueError("the packed trainer's fused LM head does not apply LoRA on the "
                         "output embedding (model.lora.target_modules)")
    return head_logprobs(hidden[0].index_select(0, batch.predict_at), head.weight,
                         head.bias, batch.targets, temperature,
                         transform=head_transform(module.config))


def packed_forward(model: torch.nn.Module, module: torch.nn.Module, batch: PackedBatch,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob, entropy without gradient) of every completion token of a packed
    micro-batch, both float32 ``(N,)``.

    ``model`` runs the forward (DDP-wrapped on several shards); ``module`` is the bare
    model, whose output embedding is the head. The model's own head runs on no row
    (``logits_to_keep`` empty); its final hidden states, gathered at the predicting
    positions, go through ``head_logprobs`` instead, with the head's own logit transform
    (``head_transform`` of the model's config: Granite's scaling, Gemma 2's soft cap).
    With FSDP2 the root's parameters (the head's weight among them) stay unsharded from
    its forward to the end of backward, and the first layer's backward queues the root's
    gradient reduction.
    """
    return _head(module, batch, _final_hidden(model, module, batch)[0], temperature)


def packed_forward_router_aux(model: torch.nn.Module, module: torch.nn.Module,
                              batch: PackedBatch, temperature: float
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``packed_forward`` of a mixture-of-experts model, plus its own router
    load-balancing loss (a scalar, with gradient) over the row's tokens.

    The model computes it (``output_router_logits``: transformers'
    ``load_balancing_loss_func`` over every layer's router logits): a packed row has no
    padding, so every token its routers saw is a real one."""
    hidden, output = _final_hidden(model, module, batch, output_router_logits=True)
    logprobs, entropy = _head(module, batch, hidden, temperature)
    return logprobs, entropy, output.aux_loss


def packed_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float
                    ) -> torch.Tensor:
    """Current-policy logprob of every completion token of a packed micro-batch (a bare
    model: its own head)."""
    return packed_forward(model, model, batch, temperature)[0]


def packed_logits(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """``(N, V)`` logits predicting each completion token of a packed micro-batch: the
    full-logits reference ``packed_forward``'s fused head is checked against. The LM head
    runs only on the positions that predict a completion token (``logits_to_keep``)."""
    logits: torch.Tensor = _run(model, batch, batch.predict_at).logits
    return logits[0]


ROWS_AT_ONCE = 1024
"""Rows of full logits ``completion_logprobs`` and ``token_entropy`` work on at once:
their float32 temporaries are ``ROWS_AT_ONCE x V``, not ``N x V``."""


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
