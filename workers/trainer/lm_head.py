"""The LM head fused with the token log-probability and entropy, a chunk of rows at a time.

Owns: ``head_logprobs``: from the hidden states at the positions that predict a
completion token, ``log softmax(h W^T / temperature)[target]`` and the entropy of that
distribution, with no ``(N, V)`` tensor ever held. Rows go ``chunk_rows(V)`` at a time
through ``h @ W^T``, log-sum-exp, gather and entropy; with gradient each chunk runs under
activation checkpointing, so backward recomputes its logits instead of keeping them.
Pure torch: Liger's fused cross entropy assumes a scalar upstream gradient (a mean
cross-entropy), while the GRPO loss weights every token's logprob differently.

At Qwen's 151,936-token vocabulary and 16k completion tokens the full logits are about
5 GB in bf16, their float32 softmax 10 GB and the gradient as much again; here the peak
is a few ``CHUNK_ELEMENTS``-sized float32 temporaries (256 MiB each).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 26
"""Logits one chunk holds (rows x vocabulary): 256 MiB in float32, 441 rows at Qwen's
151,936-token vocabulary; at the tiny models' 264 one chunk takes any micro-batch."""


def chunk_rows(vocab: int) -> int:
    """Rows per chunk for a ``vocab``-sized head."""
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target, entropy, detached) for one chunk of rows."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        # In place: nothing saved for backward holds the head's output itself.
        logits = logits.div_(temperature)
    normaliser = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        # H = -sum p log p: two vocabulary-sized temporaries, the sum as a batched dot
        # product (no product tensor).
        logp = logits - normaliser.unsqueeze(-1)
        entropy = -torch.bmm(logp.exp().unsqueeze(1), logp.unsqueeze(2)).flatten()
    return picked - normaliser, entropy


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  targets: torch.Tensor, temperature: float, rows: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 logprobs ``(N,)``, float32 entropy ``(N,)`` without gradient) of the
    ``N`` targets from hidden states ``(N, hidden)`` and the head's ``weight`` ``(V,
    hidden)`` (and ``bias``), ``rows`` at a time (default ``chunk_rows(V)``). The matmul
    runs in autocast's dtype where it is on."""
    rows = rows or chunk_rows(weight.shape[0])
    chunks = zip(hidden.split(rows), targets.split(rows), strict=True)  # >= 1, even of 0 rows
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = [checkpoint(_chunk, h, weight, bias, t, temperature, use_reentrant=False,
                        preserve_rng_state=False)  # nothing random to replay
             if grad else _chunk(h, weight, bias, t, temperature)
             for h, t in chunks]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
