"""The LM head fused with the token log-probability and entropy, a chunk of rows at a time.

Owns: ``head_logprobs``: from the hidden states at the positions that predict a
completion token, ``log softmax(f(h W^T + b) / temperature)[target]`` (``f``: the model's
own logit transform, ``workers.trainer.head_transform``) and the entropy of that
distribution, with no ``(N, V)`` tensor ever held. One autograd function
(``_FusedHead``) runs every chunk of ``chunk_rows(V)`` rows through ``h @ W^T``, the
transform, log-sum-exp, gather and entropy, checkpointed by hand: forward keeps only its
inputs and the ``(N,)`` log-sum-exp; backward recomputes each chunk's logits once and
turns them into their gradient in place (``softmax - onehot``, times the transform's
slope), so it holds one chunk of logits, and the entropy (a statistic) is not
recomputed. The weight is cast to the matmul's dtype once per pass, not per chunk, and
its gradient is one float32 ``(V, hidden)`` buffer every chunk adds into, cast to the
weight's dtype once at the end: at Qwen's 151,936-token vocabulary and 16k tokens,
per-chunk casts and per-chunk ``(V, hidden)`` gradients summed by autograd moved about
100 GB more per micro-batch. Pure torch: Liger's fused cross entropy assumes a scalar
upstream gradient (a mean cross-entropy), while the GRPO loss weights every token's
logprob differently.

At Qwen's vocabulary and 16k completion tokens the full logits are about 5 GB in bf16,
their float32 softmax 10 GB and the gradient as much again; here the peak is a few
chunk-sized float32 temporaries (``CHUNK_ELEMENTS``: 256 MiB each) and the weight's
float32 gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from workers.trainer.head_transform import HeadTransform

CHUNK_ELEMENTS = 1 << 26
"""Logits one chunk holds (rows x vocabulary): 256 MiB in float32, 441 rows at Qwen's
151,936-token vocabulary; at the tiny models' 264 one chunk takes any micro-batch."""
IDENTITY = HeadTransform()


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


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


@functools.cache
def _one_gemm_into_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch adds a product of two ``dtype`` matrices into a float32 one in
    one GEMM on ``device``: ``addmm``'s ``out_dtype`` is CUDA's only, and some torch
    versions want the added matrix in ``dtype``. Tried once, on a 1 x 1 product."""
    acc = torch.zeros(1, 1, device=device)
    one = torch.ones(1, 1, device=device, dtype=dtype)
    try:
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for a float32 ``acc``: from bf16/fp16 factors one GEMM
    accumulating in float32 where torch has it, else the factors' float32 copies (as
    exact: the product of two bf16 values is a float32 one)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _one_gemm_into_float32(acc.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            transform: HeadTransform, temperature: float) -> torch.Tensor:
    """``f(h W^T + b) / temperature`` in float32, the affine map in the inputs' dtype
    (all three cast to the matmul's already; call with autocast off)."""
    return transform.apply_(F.linear(hidden, weight, bias).float(), temperature)


def _spans(n: int, rows: int) -> list[slice]:
    return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]


class _FusedHead(torch.autograd.Function):
    """Every chunk of the head: (logprob of each target, entropy without gradient)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, targets: torch.Tensor,
                transform: HeadTransform, temperature: float, rows: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _matmul_dtype(hidden, weight)
        out = [hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(3)]
        logprobs, entropy, normaliser = out
        with torch.autocast(hidden.device.type, enabled=False):
            cast_weight, cast_bias = weight.to(dtype), _cast(bias, dtype)
            for span in _spans(hidden.shape[0], rows):
                logits = _logits(hidden[span].to(dtype), cast_weight, cast_bias, transform,
                                 temperature)
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(-1, targets[span].unsqueeze(-1)).squeeze(-1)
                logits -= lse.unsqueeze(-1)  # now log p
                # H = -sum p log p, the sum as a batched dot product (no product tensor).
                entropy[span] = -torch.bmm(logits.exp().unsqueeze(1),
                                           logits.unsqueeze(2)).flatten()
                logprobs[span], normaliser[span] = picked - lse, lse
        ctx.save_for_backward(hidden, weight, bias, targets, normaliser)
        ctx.dtype, ctx.transform, ctx.temperature, ctx.rows = dtype, transform, temperature, rows
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, normaliser = ctx.saved_tensors
        dtype, transform, temperature = ctx.dtype, ctx.transform, ctx.temperature
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # One float32 buffer for the whole call: a chunk's share is added in, never held.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if need_bias else None
        upstream = grad.float().unsqueeze(-1)
        with torch.autocast(hidden.device.type, enabled=False):
            cast_weight, cast_bias = weight.to(dtype), _cast(bias, dtype)
            for span in _spans(hidden.shape[0], ctx.rows):
                inputs = hidden[span].to(dtype)
                logits = _logits(inputs, cast_weight, cast_bias, transform, temperature)
                slope = transform.slope(logits, temperature)
                # d logprob / d logits = onehot - softmax, times the upstream gradient and
                # the transform's slope, in place: the chunk's logits become their gradient.
                scale = upstream[span]
                logits.sub_(normaliser[span].unsqueeze(-1)).exp_().mul_(-scale)
                logits.scatter_add_(-1, targets[span].unsqueeze(-1), scale)
                logits.mul_(slope)
                if grad_bias is not None:
                    grad_bias += logits.sum(0)
                grad_logits = logits.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[span] = grad_logits @ cast_weight
                if grad_weight is not None:
                    _add_product(grad_weight, grad_logits.T, inputs)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)  # the one cast, if any
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  targets: torch.Tensor, temperature: float, rows: int | None = None, *,
                  transform: HeadTransform = IDENTITY) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 logprobs ``(N,)``, float32 entropy ``(N,)`` without gradient) of the
    ``N`` targets from hidden states ``(N, hidden)`` and the head's ``weight`` ``(V,
    hidden)`` (and ``bias``), ``rows`` at a time (default ``chunk_rows(V)``), the
    head's own ``transform`` applied before the temperature. The matmul runs in
    autocast's dtype where it is on, as ``F.linear`` would."""
    rows = rows or chunk_rows(weight.shape[0])
    logprobs, entropy = _FusedHead.apply(hidden, weight, bias, targets, transform,
                                         temperature, rows)
    return logprobs, entropy
