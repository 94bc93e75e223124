"""The LM head fused with the token log-probability and entropy, a chunk of rows at a time.

Owns: ``head_logprobs``: from the hidden states at the positions that predict a
completion token, ``log softmax(h W^T / temperature)[target]`` and the entropy of that
distribution, with no ``(N, V)`` tensor ever held. Rows go ``chunk_rows(V)`` at a time
through ``h @ W^T``, log-sum-exp, gather and entropy. Each chunk is checkpointed by hand
(``_HeadChunk``, an autograd function): forward keeps only its inputs and the ``(rows,)``
log-sum-exp, backward recomputes the chunk's logits once and turns them into their
gradient in place (``softmax - onehot``), so backward holds one chunk of logits, and the
entropy (a statistic) is not recomputed. Pure torch: Liger's fused cross entropy assumes
a scalar upstream gradient (a mean cross-entropy), while the GRPO loss weights every
token's logprob differently.

At Qwen's 151,936-token vocabulary and 16k completion tokens the full logits are about
5 GB in bf16, their float32 softmax 10 GB and the gradient as much again; here the peak
is a few chunk-sized float32 temporaries (``CHUNK_ELEMENTS``: 256 MiB each).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 26
"""Logits one chunk holds (rows x vocabulary): 256 MiB in float32, 441 rows at Qwen's
151,936-token vocabulary; at the tiny models' 264 one chunk takes any micro-batch."""


def chunk_rows(vocab: int) -> int:
    """Rows per chunk for a ``vocab``-sized head."""
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """Autocast's dtype where it is on (what ``F.linear`` would compute in), else the
    inputs' common one."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """``(h W^T + b) / temperature`` in float32, the affine map in ``dtype`` (call with
    autocast off: every dtype here is explicit)."""
    logits = F.linear(hidden.to(dtype), weight.to(dtype),
                      None if bias is None else bias.to(dtype)).float()
    if temperature != 1.0:
        logits /= temperature
    return logits


class _HeadChunk(torch.autograd.Function):
    """One chunk: (logprob of each target, entropy without gradient)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, targets: torch.Tensor, temperature: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _matmul_dtype(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            logits = _logits(hidden, weight, bias, dtype, temperature)
            normaliser = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            logits -= normaliser.unsqueeze(-1)  # now log p
            # H = -sum p log p, the sum as a batched dot product (no product tensor).
            entropy = -torch.bmm(logits.exp().unsqueeze(1), logits.unsqueeze(2)).flatten()
        ctx.save_for_backward(hidden, weight, bias, targets, normaliser)
        ctx.dtype, ctx.temperature = dtype, temperature
        ctx.mark_non_differentiable(entropy)
        return picked - normaliser, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, normaliser = ctx.saved_tensors
        with torch.autocast(hidden.device.type, enabled=False):
            logits = _logits(hidden, weight, bias, ctx.dtype, ctx.temperature)
            # d logprob / d logits = onehot - softmax; times the upstream gradient and the
            # temperature's chain rule, in place: the chunk's logits become their gradient.
            scale = (grad.float() / ctx.temperature).unsqueeze(-1)
            logits.sub_(normaliser.unsqueeze(-1)).exp_().mul_(-scale)
            logits.scatter_add_(-1, targets.unsqueeze(-1), scale)
            grad_logits = logits.to(ctx.dtype)
            grad_hidden = (grad_logits @ weight.to(ctx.dtype)).to(hidden.dtype) \
                if ctx.needs_input_grad[0] else None
            grad_weight = (grad_logits.T @ hidden.to(ctx.dtype)).to(weight.dtype) \
                if ctx.needs_input_grad[1] else None
        grad_bias = grad_logits.sum(0).to(bias.dtype) \
            if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  targets: torch.Tensor, temperature: float, rows: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 logprobs ``(N,)``, float32 entropy ``(N,)`` without gradient) of the
    ``N`` targets from hidden states ``(N, hidden)`` and the head's ``weight`` ``(V,
    hidden)`` (and ``bias``), ``rows`` at a time (default ``chunk_rows(V)``). The matmul
    runs in autocast's dtype where it is on, as ``F.linear`` would."""
    rows = rows or chunk_rows(weight.shape[0])
    chunks = zip(hidden.split(rows), targets.split(rows), strict=True)  # >= 1, even of 0 rows
    parts = [_HeadChunk.apply(h, weight, bias, t, temperature) for h, t in chunks]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
