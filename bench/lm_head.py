"""Benchmark: the fused LM head, one autograd function over all chunks against the
per-chunk form it replaced, side by side in one process.

One forward and backward of ``--tokens`` rows through a ``--vocab`` x ``--hidden`` head,
``--rows`` rows a chunk, the two ways in ABBA order (``--rounds`` times, after one
warm-up call each), medians:

- ``old``: the head before (a faithful reimplementation): one autograd function per
  chunk, each casting the weight to the matmul's dtype in forward and twice in backward
  and returning its own ``(V, hidden)`` weight gradient, which autograd sums;
- ``new``: ``workers.trainer.lm_head.head_logprobs``: the weight cast once a pass,
  backward in blocks of the vocabulary, each writing its rows of one float32 weight
  gradient once.

Twice: float32 throughout, and float32 weights under bf16 autocast
(``trainer.compute_dtype = "bfloat16"``). One torch thread, so both ways see the same
machine on a shared host. The chunk size is small by default so that a CPU-sized call
has several chunks; at Qwen's 151,936 vocabulary a chunk is 441 rows.

    python bench/lm_head.py [--vocab 32768] [--hidden 256] [--tokens 2048] [--rows 128]

Its last line: ``lm_head: new/old time float32 R1, bf16 autocast R2`` (below 1: faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from workers.trainer.lm_head import head_logprobs


class _OldChunk(torch.autograd.Function):
    """One chunk of the head before: its own weight cast and weight gradient."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor,
                targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = (torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                 else torch.promote_types(hidden.dtype, weight.dtype))
        with torch.autocast(hidden.device.type, enabled=False):
            logits = F.linear(hidden.to(dtype), weight.to(dtype)).float() / temperature
            normaliser = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            logits -= normaliser.unsqueeze(-1)
            entropy = -torch.bmm(logits.exp().unsqueeze(1), logits.unsqueeze(2)).flatten()
        ctx.save_for_backward(hidden, weight, targets, normaliser)
        ctx.dtype, ctx.temperature = dtype, temperature
        ctx.mark_non_differentiable(entropy)
        return picked - normaliser, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, normaliser = ctx.saved_tensors
        with torch.autocast(hidden.device.type, enabled=False):
            logits = F.linear(hidden.to(ctx.dtype), weight.to(ctx.dtype)).float()
            logits /= ctx.temperature
            scale = (grad.float() / ctx.temperature).unsqueeze(-1)
            logits.sub_(normaliser.unsqueeze(-1)).exp_().mul_(-scale)
            logits.scatter_add_(-1, targets.unsqueeze(-1), scale)
            grad_logits = logits.to(ctx.dtype)
            grad_hidden = (grad_logits @ weight.to(ctx.dtype)).to(hidden.dtype)
            grad_weight = (grad_logits.T @ hidden.to(ctx.dtype)).to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def old_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
             temperature: float, rows: int) -> torch.Tensor:
    parts = [_OldChunk.apply(h, weight, t, temperature)
             for h, t in zip(hidden.split(rows), targets.split(rows), strict=True)]
    return torch.cat([p[0] for p in parts])


def new_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
             temperature: float, rows: int) -> torch.Tensor:
    return head_logprobs(hidden, weight, None, targets, temperature, rows)[0]


WAYS: dict[str, Callable[..., torch.Tensor]] = {"old": old_head, "new": new_head}


def one_call(way: str, args: argparse.Namespace, autocast: bool) -> float:
    """Seconds of one forward and backward, on fresh inputs of the same draw."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.05).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    upstream = torch.randn(args.tokens, generator=gen)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logprobs = WAYS[way](hidden, weight, targets, 0.7, args.rows)
    (logprobs * upstream).sum().backward()
    return time.perf_counter() - start


def compare(args: argparse.Namespace, autocast: bool) -> float:
    """new/old median time, ABBA."""
    for way in WAYS:
        one_call(way, args, autocast)  # warm-up
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in ("old", "new", "new", "old"):
            times[way].append(one_call(way, args, autocast))
    medians = {way: statistics.median(t) for way, t in times.items()}
    label = "bf16 autocast" if autocast else "float32"
    print(f"{label:>13}: old {medians['old'] * 1e3:8.1f} ms, new {medians['new'] * 1e3:8.1f}"
          f" ms (median of {2 * args.rounds} each)", flush=True)
    return medians["new"] / medians["old"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32_768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=128, help="rows a chunk")
    parser.add_argument("--rounds", type=int, default=3, help="ABBA rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    chunks = -(-args.tokens // args.rows)
    print(f"vocab {args.vocab}, hidden {args.hidden}, {args.tokens} rows in {chunks} chunks "
          f"of {args.rows}", flush=True)
    ratios = [compare(args, autocast) for autocast in (False, True)]
    print(f"lm_head: new/old time float32 {ratios[0]:.2f}, bf16 autocast {ratios[1]:.2f}")


if __name__ == "__main__":
    main()
