"""Tensors in buckets of bounded size over a gloo group: the data plane of the "gloo"
weight transport.

Owns: ``plan_buckets``, the plan every member computes from the same tensor sizes (which
bytes of which tensor travel in which message, and where in it); the broadcast group (a
``ProcessGroupGloo`` of the sender, rank 0, and every receiver, on its own ``TCPStore``,
so it shares nothing with the trainer's DDP group or vLLM's own groups); and
``send_buckets`` / ``receive_buckets``, a pipelined chain broadcast: rank 0 sends each
bucket to rank 1, and each receiver forwards every bucket to the next rank as soon as it
holds it, while the following ones arrive. Every link carries the model's bytes once,
so on a network where each member has its own link a version costs about one model
over one link plus one bucket per extra member, whatever the number of members (what
NCCL's pipelined ring broadcast does). Two messages are kept in flight so packing, the
wire and forwarding overlap. Every operation has a deadline: a dead or stuck member
fails the whole broadcast within ``timeout_s`` (its neighbours' sends or receives fail,
and the failure reaches every member down the chain). Knows nothing about vLLM, Ray,
models or versions.

A bucket is either several whole tensors packed one after another (each starting on an
``ALIGN`` boundary), or exactly one piece of a single tensor: a tensor that fits no bucket
is cut into ``bucket_bytes`` pieces, each its own message. One-piece buckets need no
packing: the sender sends the tensor's own bytes and the receiver receives straight into
the tensor it hands on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

ALIGN = 64
"""Byte boundary every packed tensor starts on: a view of the receive buffer at that
offset can be reinterpreted as any dtype, and it is cache-line aligned."""
IN_FLIGHT = 2
"""Messages posted ahead: one on the wire while the next is packed (sender) or the
previous one is loaded (receiver)."""
SENDER = 0
"""The broadcast's root: trainer shard 0. Receivers are ranks 1 .. size - 1, in chain order."""


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


# ---------------------------------------------------------------- the group


def host_store(address: str, timeout_s: float) -> dist.TCPStore:
    """The sender's store for one group, on a free port (``store.port``)."""
    return dist.TCPStore(address, 0, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A receiver's client of the sender's store."""
    return dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def broadcast_group(store: dist.Store, rank: int, size: int, timeout_s: float
                    ) -> dist.ProcessGroupGloo:
    """The gloo group of ``size`` ranks (blocks until every rank has joined). Every
    operation on it fails after ``timeout_s`` instead of waiting on a dead or stuck
    member forever."""
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------- both ends


def send_buckets(group: dist.ProcessGroupGloo, tensors: Sequence[torch.Tensor],
                 bucket_bytes: int, timeout_s: float) -> None:
    """Broadcasts ``tensors`` (CPU) from rank 0, bucket by bucket, in ``plan_buckets``
    order: each goes to rank 1, the head of the chain (nothing to send in a group of one)."""
    if group.size() < 2:
        return
    flats = [_flat(t) for t in tensors]
    timeout = timedelta(seconds=timeout_s)
    # (work, message): the message must outlive its send.
    pending: deque[tuple[dist.Work, torch.Tensor]] = deque()
    # Packing buffers, one per message in flight, reused: a buffer is packed again only
    # once its previous send has completed, and fresh memory would fault in every page.
    packing = [torch.empty(0, dtype=torch.uint8) for _ in range(IN_FLIGHT)]
    for tag, bucket in enumerate(plan_buckets([f.numel() for f in flats], bucket_bytes)):
        if len(pending) == IN_FLIGHT:
            pending.popleft()[0].wait(timeout)
        if bucket.packed:
            slot = tag % IN_FLIGHT
            if packing[slot].numel() < bucket.nbytes:
                packing[slot] = torch.empty(bucket_bytes, dtype=torch.uint8)
            message = packing[slot][:bucket.nbytes]
            for p in bucket.pieces:
                message[p.offset:p.offset + p.nbytes].copy_(flats[p.tensor][p.start:p.stop])
        else:
            (p,) = bucket.pieces
            message = flats[p.tensor][p.start:p.stop]
        # The stubs miss Backend.send/recv, which ProcessGroupGloo has.
        pending.append((group.send([message], SENDER + 1, tag), message))  # type: ignore[attr-defined]
    while pending:
        pending.popleft()[0].wait(timeout)


def receive_buckets(
    group: dist.ProcessGroupGloo, specs: Sequence[tuple[Sequence[int], torch.dtype]],
    bucket_bytes: int, timeout_s: float,
) -> Iterator[list[tuple[int, torch.Tensor]]]:
    """Receives what ``send_buckets`` broadcasts for tensors of these (shape, dtype), from
    the previous rank of the chain, forwarding each bucket to the next rank (if any) as
    soon as it is held; yields, per bucket, the (index, tensor) pairs it completed. The
    last forward is waited for before the generator ends: a member's broadcast is done
    once the next one holds every byte too.

    The tensors are fresh CPU tensors or views of a fresh buffer, never reused, so a
    consumer may keep them (the gloo engine stages a whole version before loading it).
    """
    rank, size = group.rank(), group.size()
    previous, following = rank - 1, rank + 1 if rank + 1 < size else None
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    plan = plan_buckets(sizes, bucket_bytes)
    timeout = timedelta(seconds=timeout_s)
    assembling: dict[int, torch.Tensor] = {}  # one-piece messages land in their tensor

    def post(tag: int) -> tuple[dist.Work, torch.Tensor]:
        bucket = plan[tag]
        if bucket.packed:
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
        else:
            (p,) = bucket.pieces
            if p.tensor not in assembling:
                shape, dtype = specs[p.tensor]
                assembling[p.tensor] = torch.empty(shape, dtype=dtype)
            buffer = _flat(assembling[p.tensor])[p.start:p.stop]
        return group.recv([buffer], previous, tag), buffer  # type: ignore[attr-defined]

    posted = deque(post(tag) for tag in range(min(IN_FLIGHT, len(plan))))
    # (work, message): a forwarded message must outlive its send.
    forwarding: deque[tuple[dist.Work, torch.Tensor]] = deque()
    for tag, bucket in enumerate(plan):
        work, buffer = posted.popleft()
        work.wait(timeout)
        if following is not None:
            if len(forwarding) == IN_FLIGHT:
                forwarding.popleft()[0].wait(timeout)
            forwarding.append((group.send([buffer], following, tag), buffer))  # type: ignore[attr-defined]
        if tag + IN_FLIGHT < len(plan):
            posted.append(post(tag + IN_FLIGHT))
        if bucket.packed:
            yield [(p.tensor, buffer[p.offset:p.offset + p.nbytes]
                    .view(specs[p.tensor][1]).view(specs[p.tensor][0]))
                   for p in bucket.pieces]
        else:
            (p,) = bucket.pieces
            yield [(p.tensor, assembling.pop(p.tensor))] if p.stop == sizes[p.tensor] else []
    while forwarding:
        forwarding.popleft()[0].wait(timeout)
