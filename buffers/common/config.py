"""The config vocabulary every layer's sections use, and the data plane's own sections.

Owns: the field bounds (``Positive``, ``NonNegative``, ...), ``ConfigError`` (a bad config
or override, shown as one line naming the key) and ``invalid`` (how a section's
``__post_init__`` names a bad key), plus the knobs of the replay queue (``QueueConfig``,
and ``bucket_index``: what its bucket_edges mean) and the admission gate
(``StalenessConfig``). Each component's section lives beside the component;
``async_rl.config`` assembles them into one tree. Knows nothing about TOML.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections.abc import Sequence
from typing import Annotated

import msgspec

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]


class ConfigError(Exception):
    """A bad config or override; ``str(err)`` is the one line shown to the user."""


def invalid(key: str, value: object, allowed: str) -> ValueError:
    # msgspec re-raises ValueErrors from __post_init__ as ValidationError with this text.
    return ValueError(f"{key} = {value!r}: {allowed}")


def bucket_index(edges: Sequence[int], num_tokens: int) -> int:
    """The bucket of a group of ``num_tokens`` by queue.bucket_edges: 0 below the first
    edge, len(edges) at or above the last."""
    return bisect_right(edges, num_tokens)


class QueueConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The token-length-bucketed replay queue between rollout and training."""

    max_groups: Positive = 64
    """Capacity in groups; a full queue makes rollout wait (backpressure)."""
    max_tokens: Positive = 1_000_000
    """Capacity in tokens (prompt + completion over all samples)."""
    bucket_edges: tuple[Positive, ...] = (64, 128, 256)
    """Increasing upper edges of the token-count buckets; larger groups go in a last bucket."""
    homogeneous_take: bool = False
    """Take a step's groups from one token-length bucket (then its neighbours) to cut
    padding; the oldest group, and any that would go stale next step, are always taken."""
    wait_for_expiring: bool = True
    """A step also waits for the groups still being generated that it must train so that
    none goes stale: those it is the last step allowed to train, and any the next steps
    could not all fit. Without it a late group is dropped when it arrives, and the late
    ones are the slowest to generate, the longest: the trained mix leans short. The
    price: the trainer waits for slow groups, and trained groups are older (mean
    staleness near max_staleness); on the long-tail task that bought zero drops at the
    same or better groups/s (docs/benchmarks.md). homogeneous_take picks by
    bucket among what a step need not train yet, so with it a few may still go stale."""

    def __post_init__(self) -> None:
        edges = self.bucket_edges
        for lower, upper in itertools.pairwise(edges):
            if upper <= lower:
                raise invalid("queue.bucket_edges", edges, "must be strictly increasing")


class StalenessConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How far behind the trained policy a sample may be."""

    max_staleness: NonNegative = 2
    """Hard bound η on (trained version - oldest token version); 0 = synchronous on-policy."""
    max_ahead: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """How many policy versions generation may run ahead of training: a prompt starts
    only while ``started < (version + max_ahead + 1) * groups_per_step``, while
    max_staleness stays the bound past which a group is dropped (verl's split of how
    far the rollout may run ahead from the off-policy bound). -1: max_staleness, one
    knob for both. Below max_staleness, a group that comes back late (the long tail)
    has the versions between the two to arrive in and still train, where one knob
    would either drop it or hold the whole pipeline to its pace. Above max_staleness it
    is refused: a prompt admitted that far ahead could not train within the drop bound,
    so its group would be generated only to be thrown away. At least
    weights.sync_every - 1. While the autopilot holds max_staleness below it,
    admission follows max_staleness."""

    @property
    def admission_ahead(self) -> int:
        """The versions generation may run ahead: max_ahead, or max_staleness at -1."""
        return self.max_staleness if self.max_ahead < 0 else self.max_ahead

    def __post_init__(self) -> None:
        if self.max_ahead > self.max_staleness:
            raise invalid("staleness.max_ahead", self.max_ahead,
                          f"must be <= staleness.max_staleness ({self.max_staleness}) or -1:"
                          " a prompt admitted further ahead could never train within the"
                          " drop bound")
