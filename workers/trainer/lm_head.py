"""The LM head fused with the token log-probability and entropy, a chunk at a time.

Owns: ``head_logprobs``: from the hidden states at the positions that predict a
completion token, ``log softmax(f(h W^T + b) / temperature)[target]`` (``f``: the model's
own logit transform, ``workers.trainer.head_transform``) and the entropy of that
distribution, with no ``(N, V)`` tensor ever held. One autograd function
(``_FusedHead``) checkpoints the whole head by hand. Forward runs ``chunk_rows(V)`` rows
at a time through ``h @ W^T``, the transform, log-sum-exp, gather and entropy, and keeps
only its inputs and the ``(N,)`` log-sum-exp. Backward recomputes the logits once in
blocks of the vocabulary, all N rows each and as many logits as a forward chunk, and
turns each block into its gradient in place (``softmax - onehot``, times the transform's
slope): the block's rows of the weight's gradient come whole from one GEMM over the N
rows, written once into one float32 ``(V, hidden)`` buffer, and what is summed over
blocks is the hidden states' float32 ``(N, hidden)`` gradient. The weight is cast to the
matmul's dtype once a pass. The per-chunk form before (a cast of the weight in forward
and two in backward, and a ``(V, hidden)`` gradient, per chunk, summed by autograd) moved
about 100 GB more per micro-batch at Qwen's 151,936-token vocabulary and 16k tokens. The
entropy (a statistic) is not recomputed. Pure torch: Liger's fused cross entropy assumes
a scalar upstream gradient (a mean cross-entropy), while the GRPO loss weights every
token's logprob differently.

At Qwen's vocabulary and 16k completion tokens the full logits are about 5 GB in bf16,
their float32 softmax 10 GB and the gradient as much again; here the peak is a few
chunk-sized float32 temporaries (``CHUNK_ELEMENTS``: 256 MiB each) beside the float32
gradients of the weight and the hidden states.
"""

from __future__ import annotations

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


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b``: straight into ``out`` where the dtypes agree, else the product
    in the factors' dtype (a bf16 GEMM rounds its float32 sums once) cast into it."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(a @ b)


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
        n, vocab = hidden.shape[0], weight.shape[0]
        # Blocks of the vocabulary, each all N rows, as many logits as a forward chunk:
        # each block's rows of the weight's gradient come whole from one GEMM over the N
        # rows, written once; what is summed over blocks is the smaller (N, hidden).
        width = max(1, ctx.rows * vocab // max(n, 1))
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) \
            if need_hidden else None
        grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_weight else None
        grad_bias = torch.empty(bias.shape, dtype=torch.float32, device=bias.device) \
            if need_bias else None
        upstream, lse = grad.float().unsqueeze(-1), normaliser.unsqueeze(-1)
        with torch.autocast(hidden.device.type, enabled=False):
            inputs, cast_weight = hidden.to(dtype), weight.to(dtype)
            cast_bias = _cast(bias, dtype)
            for block in _spans(vocab, width):
                block_weight = cast_weight[block]
                logits = _logits(inputs, block_weight,
                                 None if cast_bias is None else cast_bias[block],
                                 transform, temperature)
                slope = transform.slope(logits, temperature)
                # d logprob / d logits = onehot - softmax, times the upstream gradient and
                # the transform's slope, in place: the block's logits become their
                # gradient. The onehot only for the rows whose target is in the block
                # (masked, not indexed: nothing is read on the host).
                logits.sub_(lse).exp_().mul_(-upstream)
                local = targets - block.start
                inside = (local >= 0) & (local < logits.shape[1])
                logits.scatter_add_(-1, local.clamp(0, logits.shape[1] - 1).unsqueeze(-1),
                                    upstream * inside.unsqueeze(-1))
                logits.mul_(slope)
                if grad_bias is not None:
                    grad_bias[block] = logits.sum(0)
                grad_logits = logits.to(dtype)
                if grad_weight is not None:
                    _mm_into(grad_weight[block], grad_logits.T, inputs)
                if grad_hidden is not None:
                    if grad_logits.dtype == grad_hidden.dtype:
                        grad_hidden.addmm_(grad_logits, block_weight)
                    else:
                        grad_hidden += grad_logits @ block_weight
        return (_cast(grad_hidden, hidden.dtype), _cast(grad_weight, weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype),
                None, None, None, None)


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
