"""Tensors in buckets of bounded size over a gloo group: the data plane of the "gloo"
weight transport.

Owns: the broadcast group (a ``ProcessGroupGloo`` of the sender, rank 0, and every
receiver, on its own ``TCPStore``, so it shares nothing with the trainer's DDP group or
vLLM's own groups); and one broadcast of a version over it: ``send_buckets`` at the
sender, ``receive_buckets`` (chain members) or ``receive_local`` (local members) at the
receivers.

A broadcast starts once every member is in its receive (each sends the sender a ready
message: the calls that bring a member there are not the wire) and ends once every
member holds every byte (each sends the sender the time it did): ``send_buckets``
returns that span, on the machine's clock. The bytes reach a member one of two ways:

- **Local members** (on the sender's machine: they can open its shared segment, a
  ``workers.weights.shared_segment.SharedSegment``) read the version where the sender
  wrote it, once, into shared memory; the sender rings each one (a small message) when
  the last bucket is written. What a version costs them does not grow with their
  number: nothing is copied per member on the wire (each copies the tensors it loads,
  at its load), as vLLM's message queue broadcasts to local readers through shared
  memory and NCCL moves bytes between processes of one node.
- **Chain members** (the others: other machines) get a pipelined chain broadcast: the
  sender sends each bucket to the first of them, and each forwards every bucket to the
  next as soon as it holds it, while the following ones arrive. Every link carries the
  model's bytes once, so on a network where each member has its own link a version costs
  about one model over one link plus one bucket per extra member (what NCCL's pipelined
  ring broadcast does). Two messages are kept in flight so packing, the wire and
  forwarding overlap.

Every operation has a deadline: a dead or stuck member fails the whole broadcast within
``timeout_s`` (its neighbours' sends or receives fail, and the failure reaches every
member down the chain; the sender tells the local members it gave up). Knows nothing
about vLLM, Ray, models or versions.

Which bytes travel in which message is ``workers.weights.bucket_plan``'s. One-piece
buckets need no packing: the sender sends the tensor's own bytes and a chain member
receives straight into the tensor it hands on."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.weights.bucket_plan import Bucket, plan_buckets, segment_layout
from workers.weights.shared_segment import SharedSegment

IN_FLIGHT = 2
"""Messages posted ahead: one on the wire while the next is packed (sender) or the
previous one is loaded (receiver)."""
SENDER = 0
"""The broadcast's root: trainer shard 0. Receivers are ranks 1 .. size - 1."""
READY_TAG = 1 << 30
"""A member to the sender: it is in its receive, its first buffers posted."""
HELD_TAG = READY_TAG + 1
"""A member to the sender: it holds every byte, and when (``time.time()``)."""
BELL_TAG = READY_TAG + 2
"""The sender to a local member: the segment holds the version (its sequence number),
or ``ABORTED``."""
ABORTED = -1
POLL_S = 50e-6
"""How often a local member looks at the segment's sequence number while it waits."""
SPIN_S = 1.0
"""How long a local member polls before it blocks on the bell, as vLLM's shared-memory
readers spin for ``busy_loop_s`` (1 s) before they block: a poll sees the write within
``POLL_S``, where a blocked member needs two wake-ups (gloo's socket thread, then its
own), and on shared cores each may wait for a time slice. A sleeping poll leaves the
core to the sender meanwhile."""


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



def _announce(group: dist.ProcessGroupGloo, tag: int, value: float, dtype: torch.dtype
              ) -> tuple[dist.Work, torch.Tensor]:
    """A one-number message to the sender; (work, message): it must outlive its send."""
    message = torch.tensor([value], dtype=dtype)
    return group.send([message], SENDER, tag), message  # type: ignore[attr-defined]


def _collect(group: dist.ProcessGroupGloo, ranks: Sequence[int], tag: int,
             dtype: torch.dtype, timeout_s: float) -> dict[int, float]:
    """The one-number message ``tag`` from each of ``ranks``, all within ``timeout_s``."""
    posted = {rank: torch.zeros(1, dtype=dtype) for rank in ranks}
    works = {rank: group.recv([message], rank, tag)  # type: ignore[attr-defined]
             for rank, message in posted.items()}
    deadline = time.monotonic() + timeout_s
    for work in works.values():
        work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    return {rank: float(message.item()) for rank, message in posted.items()}


_ABORT = torch.tensor([ABORTED], dtype=torch.int64)
ABORT_WAIT_S = 1.0
"""How long the sender tries to tell the local members it gave a broadcast up: a member
that waits for the bell gets it at once; one that does not (dead, stuck) fails on its
own deadline."""


def _abort_local(group: dist.ProcessGroupGloo, local: Sequence[int]) -> None:
    works = []
    for rank in local:
        with contextlib.suppress(RuntimeError):  # a member that is gone
            works.append(group.send([_ABORT], rank, BELL_TAG))  # type: ignore[attr-defined]
    deadline = time.monotonic() + ABORT_WAIT_S
    for work in works:
        with contextlib.suppress(RuntimeError):
            work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))


# ---------------------------------------------------------------- the sender


def send_buckets(group: dist.ProcessGroupGloo, tensors: Sequence[torch.Tensor],
                 bucket_bytes: int, timeout_s: float, *, local: Sequence[int] = (),
                 segment: SharedSegment | None = None) -> tuple[float, float]:
    """Broadcasts ``tensors`` (CPU) from rank 0, in ``plan_buckets`` order: written once
    into ``segment`` (laid out by ``segment_layout``) for the ``local`` ranks, and sent
    bucket by bucket to the first of the other ranks, the chain.

    Returns once every member holds every byte: (when the first byte was sent, when the
    last member held it all), on ``time.time()``; (0, 0) in a group of the sender alone.
    """
    size = group.size()
    if size < 2:
        return 0.0, 0.0
    if local and segment is None:
        raise ValueError("local members read a shared segment: none was given")
    chain = [rank for rank in range(1, size) if rank not in set(local)]
    flats = [_flat(t) for t in tensors]
    plan = plan_buckets([f.numel() for f in flats], bucket_bytes)
    offsets, total = segment_layout(plan)
    if segment is not None and local and segment.nbytes < total:
        raise ValueError(f"shared segment of {segment.nbytes} bytes: the version needs {total}")
    timeout = timedelta(seconds=timeout_s)
    rung = False
    try:
        # The calls that bring each member into its receive are not the wire.
        _collect(group, range(1, size), READY_TAG, torch.int64, timeout_s)
        began = time.time()
        number = segment.begin_write() if segment is not None and local else 0
        # (work, message): the message must outlive its send.
        pending: deque[tuple[dist.Work, torch.Tensor]] = deque()
        # Packing buffers for the chain alone, one per message in flight, reused: a
        # buffer is packed again only once its previous send has completed, and fresh
        # memory would fault in every page. With local members the segment is the
        # packing buffer: every bucket has its own place, so none waits for a send.
        packing = [torch.empty(0, dtype=torch.uint8) for _ in range(IN_FLIGHT)]
        for tag, bucket in enumerate(plan):
            if number and segment is not None:
                message = segment.data[offsets[tag]:offsets[tag] + bucket.nbytes]
                _pack(bucket, flats, message)
            else:
                if len(pending) == IN_FLIGHT:
                    pending.popleft()[0].wait(timeout)
                message = _message(bucket, flats, packing, tag % IN_FLIGHT, bucket_bytes)
            if chain:
                # The stubs miss Backend.send/recv, which ProcessGroupGloo has.
                pending.append((group.send([message], chain[0], tag), message))  # type: ignore[attr-defined]
        bells = []
        if number and segment is not None:
            segment.seq = number
            bell = torch.tensor([number], dtype=torch.int64)
            bells = [group.send([bell], rank, BELL_TAG)  # type: ignore[attr-defined]
                     for rank in local]
            rung = True
        for work in [w for w, _ in pending] + bells:
            work.wait(timeout)
    except Exception:
        if not rung:
            if segment is not None and local:
                segment.seq = ABORTED  # for the members polling it
            _abort_local(group, local)
        raise
    held = _collect(group, range(1, size), HELD_TAG, torch.float64, timeout_s)
    return began, max(held.values())


def _pack(bucket: Bucket, flats: Sequence[torch.Tensor], message: torch.Tensor) -> None:
    for p in bucket.pieces:
        message[p.offset:p.offset + p.nbytes].copy_(flats[p.tensor][p.start:p.stop])


def _message(bucket: Bucket, flats: Sequence[torch.Tensor], packing: list[torch.Tensor],
             slot: int, bucket_bytes: int) -> torch.Tensor:
    """A chain message: a packed bucket in packing buffer ``slot``, or the bytes of the
    one tensor piece it is, as they are."""
    if not bucket.packed:
        (p,) = bucket.pieces
        return flats[p.tensor][p.start:p.stop]
    if packing[slot].numel() < bucket.nbytes:
        packing[slot] = torch.empty(bucket_bytes, dtype=torch.uint8)
    message = packing[slot][:bucket.nbytes]
    _pack(bucket, flats, message)
    return message


# ---------------------------------------------------------------- the receivers


def receive_buckets(
    group: dist.ProcessGroupGloo, specs: Sequence[tuple[Sequence[int], torch.dtype]],
    bucket_bytes: int, timeout_s: float, chain: Sequence[int] | None = None,
) -> Iterator[list[tuple[int, torch.Tensor]]]:
    """A chain member's part of ``send_buckets``'s broadcast of tensors of these (shape,
    dtype): receives from the previous member of ``chain`` (the receiving ranks that are
    not local, in order; None: every receiver), forwarding each bucket to the next one
    (if any) as soon as it is held; yields, per bucket, the (index, tensor) pairs it
    completed. The last forward is waited for before the generator ends: a member's
    broadcast is done once the next one holds every byte too.

    The tensors are fresh CPU tensors or views of a fresh buffer, never reused, so a
    consumer may keep them (the gloo engine stages a whole version before loading it).
    """
    rank, size = group.rank(), group.size()
    order = list(chain) if chain is not None else list(range(1, size))
    at = order.index(rank)
    previous = order[at - 1] if at else SENDER
    following = order[at + 1] if at + 1 < len(order) else None
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
    ready = _announce(group, READY_TAG, 0, torch.int64)
    held = _announce(group, HELD_TAG, time.time(), torch.float64) if not plan else None
    # (work, message): a forwarded message must outlive its send.
    forwarding: deque[tuple[dist.Work, torch.Tensor]] = deque()
    for tag, bucket in enumerate(plan):
        work, buffer = posted.popleft()
        work.wait(timeout)
        if tag == len(plan) - 1:
            held = _announce(group, HELD_TAG, time.time(), torch.float64)
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
    assert held is not None  # announced with the last bucket
    for work, _ in (ready, held):
        work.wait(timeout)


def receive_local(group: dist.ProcessGroupGloo, segment: SharedSegment,
                  specs: Sequence[tuple[Sequence[int], torch.dtype]], bucket_bytes: int,
                  timeout_s: float) -> tuple[int, list[tuple[int, torch.Tensor]]]:
    """A local member's part of ``send_buckets``'s broadcast: waits for the write (it
    polls the segment's sequence number for up to ``SPIN_S``, then blocks on the bell),
    then returns the write's number and every tensor, in order, as a view of
    ``segment``: valid while ``segment.seq`` still equals that number (the sender writes
    again only for a later broadcast). Raises RuntimeError when the sender gave the
    broadcast up or the deadline passed."""
    timeout = timedelta(seconds=timeout_s)
    bell = torch.zeros(1, dtype=torch.int64)
    rung = group.recv([bell], SENDER, BELL_TAG)  # type: ignore[attr-defined]
    last = segment.seq  # the sender writes only once every member is ready
    ready = _announce(group, READY_TAG, 0, torch.int64)
    held_at = _poll(segment, last)
    held = (_announce(group, HELD_TAG, held_at, torch.float64) if held_at is not None
            else None)
    rung.wait(timeout)  # every bell is taken: the next broadcast's must not meet it
    number = int(bell.item())
    if number == ABORTED:
        raise RuntimeError("the weight sender gave the broadcast up")
    if segment.seq != number:
        raise RuntimeError(f"shared segment holds write {segment.seq}, the bell rang for "
                           f"{number}")
    if held is None:
        held = _announce(group, HELD_TAG, time.time(), torch.float64)
    tensors = segment_views(segment, specs, bucket_bytes)
    for work, _ in (ready, held):
        work.wait(timeout)
    return number, tensors


def _poll(segment: SharedSegment, last: int) -> float | None:
    """When (``time.time()``) the segment held a write newer than ``last``; None if it
    did not within ``SPIN_S`` or the sender gave up (the bell says which)."""
    deadline = time.monotonic() + SPIN_S
    while time.monotonic() < deadline:
        seq = segment.seq
        if seq == ABORTED:
            return None
        if seq > last:
            return time.time()
        time.sleep(POLL_S)
    return None


def segment_views(segment: SharedSegment, specs: Sequence[tuple[Sequence[int], torch.dtype]],
                  bucket_bytes: int) -> list[tuple[int, torch.Tensor]]:
    """Every tensor of these (shape, dtype) as a view of the segment ``send_buckets``
    wrote them to."""
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    plan = plan_buckets(sizes, bucket_bytes)
    offsets, _ = segment_layout(plan)
    starts = {p.tensor: offset + p.offset for bucket, offset in zip(plan, offsets, strict=True)
              for p in bucket.pieces if p.start == 0}
    views = []
    for index, (shape, dtype) in enumerate(specs):
        start = starts[index]
        run = segment.data[start:start + sizes[index]]
        views.append((index, run.view(dtype).view(shape) if sizes[index]
                      else torch.empty(shape, dtype=dtype)))
    return views
