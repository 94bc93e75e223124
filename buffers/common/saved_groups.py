"""Generated groups as bytes, tokens included: what a checkpoint keeps of the replay queue.

Owns: ``SavedGroup`` (a ``Group`` with its ``GroupTokens`` beside it and the policy
version it entered the queue at), and ``encode_groups`` / ``decode_groups``: msgpack,
every numpy array one extension value (its dtype, then its bytes), so token ids,
behaviour log-probs and per-token versions come back bit for bit. Decoding checks what
a damaged or foreign file would get wrong (each array's dtype against ``GroupTokens``'
fields, the arrays' lengths against each other and against the group's own lengths)
and refuses it with ``ValueError`` in one line, rather than train on it. Knows nothing
about checkpoints' folders or where a run keeps its tokens.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from buffers.common.records import Group, GroupTokens

__all__ = ["SavedGroup", "decode_groups", "encode_groups"]

_ARRAY = 1
"""The msgpack extension code of a numpy array."""
_DTYPES = frozenset({"<i4", "<i8", "<f4", "|i1"})
"""The dtypes ``GroupTokens`` holds (little-endian, as written)."""


class SavedGroup(msgspec.Struct, frozen=True, kw_only=True):
    """One queued group as a checkpoint keeps it."""

    group: Group
    """The group's record, ``tokens`` left empty (a reference means nothing on disk)."""
    tokens: GroupTokens | None
    """Its token arrays: ids, behaviour log-probs, per-token versions, loss mask; None
    when the group carried none (a simulated one)."""
    entered_version: int | None = None
    """The policy version when it entered the queue (its staleness in the queue counts
    from there); None: unknown, it enters anew."""


def _encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
        return msgspec.msgpack.Ext(_ARRAY, array.dtype.str.encode() + b"\0" + array.tobytes())
    # msgspec's hook protocol: NotImplementedError says "not a type this hook knows", and
    # the encoder turns it into its own error naming the value.
    raise NotImplementedError(f"cannot save a {type(value).__name__}")


def _ext(code: int, data: memoryview) -> Any:
    kind, _, raw = bytes(data).partition(b"\0")
    dtype = kind.decode(errors="replace")
    if code != _ARRAY or dtype not in _DTYPES:
        raise ValueError(f"unknown value (extension {code}, dtype {dtype!r})")
    if len(raw) % np.dtype(dtype).itemsize:
        raise ValueError(f"a {dtype} array of {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype)


def _decode(kind: type, value: Any) -> Any:
    """A decoded array, checked against the field's ``NDArray[dtype]``."""
    if typing.get_origin(kind) is np.ndarray and isinstance(value, np.ndarray):
        (wanted,) = typing.get_args(typing.get_args(kind)[1])
        if value.dtype != np.dtype(wanted):
            raise ValueError(f"a {value.dtype} array where {np.dtype(wanted)} belongs")
        return value
    raise NotImplementedError(f"cannot load a {kind}")  # msgspec's hook protocol, as above


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode)
_DECODER = msgspec.msgpack.Decoder(tuple[SavedGroup, ...], dec_hook=_decode, ext_hook=_ext)


def encode_groups(groups: Sequence[SavedGroup]) -> bytes:
    """The groups as one msgpack document (their ``tokens`` references left out)."""
    return _ENCODER.encode(tuple(msgspec.structs.replace(s, group=msgspec.structs.replace(
        s.group, tokens=None)) for s in groups))


def decode_groups(data: bytes) -> tuple[SavedGroup, ...]:
    """The groups ``encode_groups`` wrote; ``ValueError`` in one line when the bytes are
    not such groups, or their arrays do not agree with them."""
    try:
        groups = _DECODER.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError) as err:
        raise ValueError(f"not a file of saved groups ({str(err).splitlines()[0]})") from None
    for k, saved in enumerate(groups):
        if saved.tokens is not None and (why := _disagreement(saved.group, saved.tokens)):
            raise ValueError(f"group {k} ({saved.group.prompt_id!r}): {why}")
    return groups


def _disagreement(group: Group, tokens: GroupTokens) -> str:
    """Why the arrays cannot be this group's ("" when they can)."""
    lengths = np.diff(tokens.offsets)
    total = len(tokens.completion_token_ids)
    if len(tokens.prompt_token_ids) != group.prompt_length:
        return f"{len(tokens.prompt_token_ids)} prompt tokens, the group says {group.prompt_length}"
    if (len(tokens.offsets) != group.num_samples + 1 or tokens.offsets[0] != 0
            or tuple(int(n) for n in lengths) != group.completion_lengths):
        return f"completion offsets {tokens.offsets.tolist()} do not give its lengths"
    sizes = {len(tokens.logprobs), len(tokens.versions), total,
             *(() if tokens.loss_mask is None else (len(tokens.loss_mask),))}
    if sizes != {int(tokens.offsets[-1])}:
        return f"arrays of {sorted(sizes)} tokens for {int(tokens.offsets[-1])} completion tokens"
    return ""
