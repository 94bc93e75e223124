"""Per-token advantages from a critic: generalised advantage estimation (GAE).

Owns: the outcome reward laid on each sequence's last policy token (``token_rewards``),
the GAE recursion over policy tokens only (``gae``), whitening the advantages over every
trained token of a step (``moments``, ``whiten``), and moving per-token values between
the trainer's flat layout (a micro-batch's trained tokens end to end) and one padded row
per sequence (``Rows``, ``to_rows``, ``from_rows``). Knows nothing about models, shards
or the loss: callers pass tensors and the moments every shard agreed on.

Nothing here reads a device value on the host or copies host values to the device
(each a wait for the device on CUDA): masks select with ``torch.where`` and sums, the
row layout moves values by an index computed on the host and sent by the caller, and
``whiten`` takes the moments already on the host.

Policy tokens only: a multi-turn trajectory's observation tokens (loss mask 0) are not
steps of the policy, so they get no advantage, no value and no reward, and the recursion
steps over them: the value a policy token bootstraps from is the next *policy* token's,
and the discount applies once per policy token (verl's multi-turn GAE skips masked
positions the same way). In the flat layout observation tokens are not there at all, so
every position of a row is a policy token and ``mask`` marks only the padding.

With ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V`` after the last token is 0):

    A_t = delta_t + gamma * lam * A_{t+1}        R_t = A_t + V_t

``R`` (the returns) is the critic's target; ``A`` is whitened over the step's trained
tokens (mean 0, variance 1 with Bessel's correction) before the policy loss uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

WHITEN_EPS = 1e-8
"""Added to the variance before its square root (verl's and TRL's)."""


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(S, L)``: each row's scalar reward (``rewards``, ``(S,)``) on its last position
    with mask 1, zero elsewhere (a row with no such position gets none: its last is -1,
    which no position equals)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).amax(dim=1, keepdim=True)
    return torch.where(positions == last, rewards[:, None], 0.0)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), ``(S, L)`` each, for rows of per-token ``rewards`` and
    ``values``; positions with ``mask`` 0 are skipped by the recursion and get 0 in both."""
    keep = mask.bool()
    advantages = torch.zeros_like(values)
    following_value = values.new_zeros(values.shape[0])
    following_advantage = values.new_zeros(values.shape[0])
    for t in range(values.shape[1] - 1, -1, -1):
        here = keep[:, t]
        delta = rewards[:, t] + gamma * following_value - values[:, t]
        advantage = delta + gamma * lam * following_advantage
        # A skipped position leaves the carried value and advantage as they were.
        following_value = torch.where(here, values[:, t], following_value)
        following_advantage = torch.where(here, advantage, following_advantage)
        advantages[:, t] = torch.where(here, advantage, 0.0)
    return advantages, torch.where(keep, advantages + values, 0.0)


def moments(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``(3,)`` on ``values``' device: count, sum and sum of squares of
    ``values`` where ``mask`` is 1 (everywhere without a mask): what shards all-reduce
    before ``whiten``."""
    values = values.double()
    if mask is None:
        count = values.new_full((), values.numel())
    else:
        keep = mask.bool()
        values, count = torch.where(keep, values, 0.0), keep.sum().double()
    return torch.stack([count, values.sum(), values.square().sum()])


def whiten(values: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """``values`` shifted to mean 0 and scaled to variance 1 by ``totals`` (``moments``
    summed over every shard, on the host): Bessel-corrected variance; a single value (or
    none) has variance 0, so it whitens to 0."""
    count, total, squares = totals.tolist()
    if count < 1:
        return torch.zeros_like(values)
    mean = total / count
    variance = max(squares - total * mean, 0.0) / (count - 1) if count > 1 else 0.0
    return ((values.double() - mean) / (variance + WHITEN_EPS) ** 0.5).to(values.dtype)


def row_index(lengths: Sequence[int]) -> torch.Tensor:
    """int64 ``(N,)`` on the host: where each value of the flat layout (``lengths``
    values per sequence, end to end) sits in rows of width ``max(lengths)`` read end to
    end. Send it to the device (one copy with the micro-batch's other host values) and
    lay the rows out with ``Rows.of``."""
    counts = np.asarray(lengths, dtype=np.int64)
    width = int(counts.max(initial=0))
    starts = np.cumsum(counts) - counts
    flat = np.arange(int(counts.sum()), dtype=np.int64)
    return torch.from_numpy(flat + np.repeat(np.arange(len(counts)) * width - starts, counts))


@dataclass(frozen=True, slots=True)
class Rows:
    """The padded-row layout of one micro-batch's flat values, on their device."""

    index: torch.Tensor
    """``row_index``: each flat value's place in the rows read end to end."""
    mask: torch.Tensor
    """``(S, width)`` bool: the real positions."""

    @classmethod
    def of(cls, lengths: Sequence[int], index: torch.Tensor | None = None) -> Rows:
        """``lengths``' layout; ``index``: their ``row_index`` already on the device
        (None: made here, on the host)."""
        index = row_index(lengths) if index is None else index
        shape = (len(lengths), max(lengths, default=0))
        mask = torch.zeros(shape[0] * shape[1], dtype=torch.bool, device=index.device)
        return cls(index=index, mask=mask.index_fill_(0, index, True).view(shape))


def to_rows(flat: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The flat layout's ``(N,)`` values as ``(S, width)`` rows, right-padded with 0."""
    out = flat.new_zeros(rows.mask.numel()).index_copy_(0, rows.index, flat)
    return out.view(rows.mask.shape)


def from_rows(values: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``to_rows`` undone: the real positions, row after row, as ``(N,)``."""
    return values.reshape(-1).index_select(0, rows.index)
