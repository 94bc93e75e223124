"""How a version's tensors are cut into messages: the plan every member of a weight
broadcast computes from the same tensor sizes.

Owns: ``plan_buckets`` (which bytes of which tensor travel in which message, and where
in it) and ``segment_layout`` (where each message sits in a shared segment, so that
every tensor is one contiguous, aligned run of it). Pure: sizes in, offsets out.

A bucket is either several whole tensors packed one after another (each starting on an
``ALIGN`` boundary), or exactly one piece of a single tensor: a tensor that fits no bucket
is cut into ``bucket_bytes`` pieces, each its own message.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

ALIGN = 64
"""Byte boundary every packed tensor starts on: a view of the receive buffer at that
offset can be reinterpreted as any dtype, and it is cache-line aligned."""

class Piece(msgspec.Struct, frozen=True, kw_only=True):
    """A byte range of one tensor, and where it sits in its bucket's message."""

    tensor: int
    """Index of the tensor in the update's order."""
    start: int
    """First byte within the tensor."""
    stop: int
    """One past the last byte within the tensor."""
    offset: int
    """First byte within the bucket's message."""

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


class Bucket(msgspec.Struct, frozen=True, kw_only=True):
    """One message: its pieces in order, and its size."""

    pieces: tuple[Piece, ...]
    nbytes: int

    @property
    def packed(self) -> bool:
        """Several tensors in one buffer; otherwise the message is one tensor's bytes."""
        return len(self.pieces) > 1


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> tuple[Bucket, ...]:
    """Buckets of at most ``bucket_bytes`` each, covering every byte of every tensor once,
    in tensor order; ``sizes`` are the tensors' sizes in bytes."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes = {bucket_bytes}: must be at least {ALIGN}")
    buckets: list[Bucket] = []
    open_pieces: list[Piece] = []
    fill = 0

    def close() -> None:
        nonlocal fill
        if open_pieces:
            buckets.append(Bucket(pieces=tuple(open_pieces), nbytes=fill))
            open_pieces.clear()
            fill = 0

    for index, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"tensor {index} has a negative size ({size})")
        if size > bucket_bytes:
            close()
            for start in range(0, size, bucket_bytes):
                stop = min(start + bucket_bytes, size)
                piece = Piece(tensor=index, start=start, stop=stop, offset=0)
                buckets.append(Bucket(pieces=(piece,), nbytes=stop - start))
            continue
        offset = _align(fill)
        if open_pieces and offset + size > bucket_bytes:
            close()
            offset = 0
        open_pieces.append(Piece(tensor=index, start=0, stop=size, offset=offset))
        fill = offset + size
    close()
    return tuple(buckets)


def segment_layout(plan: Sequence[Bucket]) -> tuple[list[int], int]:
    """Where each bucket of ``plan`` starts in a shared segment, and the segment's size.
    A bucket starts on an ``ALIGN`` boundary, except a piece that continues a split
    tensor: it follows the previous piece at once, so every tensor is one contiguous,
    aligned run of the segment (a view of it is the tensor)."""
    offsets: list[int] = []
    end = 0
    for bucket in plan:
        continues = bucket.pieces[0].start > 0
        offsets.append(end if continues else _align(end))
        end = offsets[-1] + bucket.nbytes
    return offsets, end
