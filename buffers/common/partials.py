"""Partial rollouts: what an engine hands back of a group it was still generating.

Owns: ``PartialSample`` (one sample's tokens so far, their behaviour log-probs and
per-token versions, and why it stopped if it had finished), ``PartialGroup`` (a prompt's
partial samples as one engine handed them back, at a clean stop of the run or of that
engine), and ``encode_partials`` / ``decode_partials``: the msgpack file a checkpoint
keeps them in, whose decoding refuses a damaged or foreign file in one line
(``ValueError``) rather than continue a rollout from it. Floats are written as msgpack's
64-bit floats, so every log-prob comes back bit for bit. Knows nothing about engines,
checkpoints' folders or how a rollout continues (``workers.rollout.continuation``).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from buffers.common.records import NO_VERSION, Prompt

__all__ = ["FINISHED", "PartialGroup", "PartialSample", "decode_partials", "encode_partials"]

FINISHED = frozenset({"stop", "length"})
"""The finish reasons of a sample that needs no continuation."""


class PartialSample(msgspec.Struct, frozen=True, kw_only=True):
    """One sample of a partial group: its completion tokens so far."""

    token_ids: tuple[int, ...]
    """Completion tokens the engine had produced (none: the request had not started)."""
    logprobs: tuple[float, ...]
    """Their behaviour log-probabilities, exactly as the engine gave them."""
    versions: tuple[int, ...]
    """The policy version that produced each of them."""
    finish_reason: str = ""
    """"stop" or "length" when the sample had finished before the hand-back (it is kept
    whole and not continued); "" when it was cut short."""

    @property
    def finished(self) -> bool:
        return self.finish_reason in FINISHED


class PartialGroup(msgspec.Struct, frozen=True, kw_only=True):
    """A prompt's samples as an engine handed them back, to be continued elsewhere."""

    prompt: Prompt
    prompt_token_ids: tuple[int, ...]
    """The prompt's token ids as the engine used them: the continuation's prompt begins
    with them (empty only when ``samples`` is)."""
    samples: tuple[PartialSample, ...]
    """Every sample of the group, finished or not; empty: nothing is kept and the prompt
    runs again from the start (``restarts`` says why)."""
    rollout_rank: int = 0
    """The engine that handed it back."""
    restarts: str = ""
    """Why nothing is kept ("" when ``samples`` holds the group): "multi_turn" (a
    trajectory's environment state cannot be saved), "not_started"."""
    leaving: bool = False
    """The engine handed it back because it is stopping itself (it must be replaced),
    not because the run stops."""

    @property
    def kept_lengths(self) -> tuple[int, ...]:
        """Completion tokens kept per sample."""
        return tuple(len(s.token_ids) for s in self.samples)

    @property
    def kept_tokens(self) -> int:
        return sum(self.kept_lengths)

    @property
    def min_version(self) -> int:
        """Oldest version of a kept policy token (``NO_VERSION``: none kept): the
        staleness of whatever the continuation makes of it is at least this old."""
        return min((v for s in self.samples for v in s.versions if v != NO_VERSION),
                   default=NO_VERSION)

    @property
    def num_tokens(self) -> int:
        """Prompt plus kept completion tokens over all samples."""
        return self.kept_tokens + len(self.prompt_token_ids) * len(self.samples)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(tuple[PartialGroup, ...])


def encode_partials(groups: Sequence[PartialGroup]) -> bytes:
    """The partial groups as one msgpack document."""
    return _ENCODER.encode(tuple(groups))


def decode_partials(data: bytes) -> tuple[PartialGroup, ...]:
    """The groups ``encode_partials`` wrote; ``ValueError`` in one line when the bytes are
    not such groups or a sample's arrays disagree."""
    try:
        groups = _DECODER.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError) as err:
        raise ValueError(f"not a file of partial rollouts ({str(err).splitlines()[0]})"
                         ) from None
    for k, group in enumerate(groups):
        if why := _disagreement(group):
            raise ValueError(f"partial group {k} ({group.prompt.prompt_id!r}): {why}")
    return groups


def _disagreement(group: PartialGroup) -> str:
    """Why the group cannot be continued ("" when it can)."""
    if group.samples and not group.prompt_token_ids:
        return "samples without prompt tokens"
    for j, sample in enumerate(group.samples):
        n = len(sample.token_ids)
        if len(sample.logprobs) != n or len(sample.versions) != n:
            return (f"sample {j}: {n} tokens, {len(sample.logprobs)} log-probs, "
                    f"{len(sample.versions)} versions")
        if sample.finish_reason and not sample.finished:
            return f"sample {j}: finish reason {sample.finish_reason!r}"
    return ""
