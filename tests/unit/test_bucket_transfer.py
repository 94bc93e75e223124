"""Bucketed tensor transfer: the plan (pure), and broadcasts over real gloo groups of two
to five ranks inside one process (a thread per rank; no Ray, no vLLM): every member gets
every tensor exactly, and a dead or stuck member fails the whole chain within the
timeout."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from workers.weights.bucket_plan import ALIGN, Bucket, plan_buckets
from workers.weights.bucket_transfer import (
    SENDER,
    broadcast_group,
    host_store,
    join_store,
    receive_buckets,
    send_buckets,
)

RECEIVER = SENDER + 1


def covered(buckets: tuple[Bucket, ...], count: int) -> list[list[tuple[int, int]]]:
    """Per tensor, the byte ranges the plan sends, in message order."""
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    for bucket in buckets:
        for piece in bucket.pieces:
            ranges[piece.tensor].append((piece.start, piece.stop))
    return ranges


def test_small_tensors_are_packed_aligned_until_the_bucket_is_full() -> None:
    buckets = plan_buckets([100, 28, 900, 4], bucket_bytes=1024)
    assert [[(p.tensor, p.offset) for p in b.pieces] for b in buckets] == [
        [(0, 0), (1, 128)], [(2, 0), (3, 960)]]
    assert [b.nbytes for b in buckets] == [156, 964]
    assert all(b.packed for b in buckets)


def test_a_tensor_larger_than_a_bucket_travels_alone_in_pieces() -> None:
    buckets = plan_buckets([10, 2500, 10], bucket_bytes=1024)
    assert [(b.packed, b.nbytes) for b in buckets] == [
        (False, 10), (False, 1024), (False, 1024), (False, 452), (False, 10)]
    assert covered(buckets, 3)[1] == [(0, 1024), (1024, 2048), (2048, 2500)]
    # A lone whole tensor is a one-piece message too: sent and received without packing.
    assert [(p.tensor, p.start, p.stop, p.offset) for p in buckets[0].pieces] == [(0, 0, 10, 0)]


def test_empty_update_and_empty_tensors() -> None:
    assert plan_buckets([], bucket_bytes=ALIGN) == ()
    (bucket,) = plan_buckets([0, 8], bucket_bytes=ALIGN)
    assert [(p.tensor, p.nbytes) for p in bucket.pieces] == [(0, 0), (1, 8)]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        plan_buckets([1], bucket_bytes=ALIGN - 1)
    with pytest.raises(ValueError, match="negative"):
        plan_buckets([-1], bucket_bytes=1024)


@given(st.lists(st.integers(0, 5000), max_size=40), st.integers(ALIGN, 4096))
def test_every_byte_travels_once_in_order_within_bounds(
    sizes: list[int], bucket_bytes: int
) -> None:
    buckets = plan_buckets(sizes, bucket_bytes)
    assert all(0 < b.nbytes <= bucket_bytes or b.nbytes == 0 for b in buckets)
    order = [p.tensor for b in buckets for p in b.pieces]
    assert order == sorted(order)
    for size, ranges in zip(sizes, covered(buckets, len(sizes)), strict=True):
        starts = [start for start, _ in ranges]
        stops = [stop for _, stop in ranges]
        assert starts[0] == 0 and stops[-1] == size and starts[1:] == stops[:-1]
    for bucket in buckets:
        ends = [p.offset + p.nbytes for p in bucket.pieces]
        assert ends[-1] == bucket.nbytes
        assert all(p.offset % ALIGN == 0 for p in bucket.pieces)
        assert all(b.offset >= end for b, end in zip(bucket.pieces[1:], ends, strict=False))
        # Pieces of a split tensor never share a message with anything else.
        if any(p.nbytes < sizes[p.tensor] for p in bucket.pieces):
            assert not bucket.packed


def open_group(size: int, timeout_s: float) -> dict[int, torch.distributed.ProcessGroupGloo]:
    """Every rank of a broadcast group, in this process (each joins on its own thread)."""
    store = host_store("127.0.0.1", timeout_s=timeout_s)
    groups: dict[int, torch.distributed.ProcessGroupGloo] = {}

    def join(rank: int) -> None:
        peer = (store if rank == SENDER
                else join_store("127.0.0.1", store.port, timeout_s=timeout_s))
        groups[rank] = broadcast_group(peer, rank, size, timeout_s=timeout_s)

    joiners = [threading.Thread(target=join, args=(rank,)) for rank in range(1, size)]
    for joiner in joiners:
        joiner.start()
    join(SENDER)
    for joiner in joiners:
        joiner.join()
    assert sorted(groups) == list(range(size))
    return groups


def open_pair(timeout_s: float) -> dict[int, torch.distributed.ProcessGroupGloo]:
    return open_group(2, timeout_s)


def receive_all(group: torch.distributed.ProcessGroupGloo, specs: list[Any],
                bucket_bytes: int, timeout_s: float, out: dict[int, Any]) -> None:
    """One receiver's whole broadcast: its batches, or the error it failed with."""
    try:
        out[group.rank()] = list(receive_buckets(group, specs, bucket_bytes, timeout_s))
    except RuntimeError as err:
        out[group.rank()] = err


def test_round_trip_over_a_gloo_pair_delivers_every_tensor_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=gen),                      # packed with the next ones
        torch.arange(7, dtype=torch.int64),
        torch.randn(4, generator=gen).to(torch.bfloat16),      # 2-byte dtype after 8-byte
        torch.randn(40, 30, generator=gen),                    # 4800 bytes: split in pieces
        torch.tensor(2.5),                                     # 0-dim
        torch.randn(6, 4, generator=gen).t(),                  # not contiguous
    ]
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    bucket_bytes = 1024
    groups = open_pair(timeout_s=30)
    sender = threading.Thread(target=send_buckets,
                              args=(groups[SENDER], tensors, bucket_bytes, 30.0))
    sender.start()
    batches = list(receive_buckets(groups[RECEIVER], specs, bucket_bytes, 30.0))
    sender.join()
    assert len(batches) == len(plan_buckets(
        [t.numel() * t.element_size() for t in tensors], bucket_bytes))
    received = dict(pair for batch in batches for pair in batch)
    assert sorted(received) == list(range(len(tensors)))
    for index, tensor in enumerate(tensors):
        assert received[index].dtype == tensor.dtype
        assert torch.equal(received[index], tensor)


def test_a_peer_that_never_receives_fails_the_send_after_the_timeout() -> None:
    groups = open_pair(timeout_s=1.0)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out"):
        send_buckets(groups[SENDER], [torch.zeros(4096)], 1024, timeout_s=1.0)
    assert time.monotonic() - began < 10


def test_a_dead_peer_fails_the_send_at_once() -> None:
    groups = open_pair(timeout_s=60.0)
    del groups[RECEIVER]  # its connections close, as a dead process's would
    gc.collect()
    began = time.monotonic()
    with pytest.raises(RuntimeError):
        send_buckets(groups[SENDER], [torch.zeros(4096)], 1024, timeout_s=60.0)
    assert time.monotonic() - began < 10


@pytest.mark.parametrize("size", [3, 5])
def test_a_chain_broadcast_delivers_every_tensor_to_every_member(size: int) -> None:
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(40, 30, generator=gen), torch.arange(9, dtype=torch.int64),
               torch.randn(5, generator=gen).to(torch.bfloat16)]
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    groups = open_group(size, timeout_s=30)
    out: dict[int, Any] = {}
    receivers = [threading.Thread(target=receive_all, args=(groups[rank], specs, 1024, 30.0,
                                                            out))
                 for rank in range(1, size)]
    for receiver in receivers:
        receiver.start()
    send_buckets(groups[SENDER], tensors, 1024, 30.0)
    for receiver in receivers:
        receiver.join()
    assert sorted(out) == list(range(1, size))
    for rank, batches in out.items():
        assert isinstance(batches, list), f"rank {rank}: {batches!r}"
        received = dict(pair for batch in batches for pair in batch)
        assert sorted(received) == [0, 1, 2]
        for index, tensor in enumerate(tensors):
            assert torch.equal(received[index], tensor)


def test_a_group_of_the_sender_alone_sends_nothing() -> None:
    (group,) = open_group(1, timeout_s=5).values()
    send_buckets(group, [torch.zeros(8)], 1024, 5.0)  # returns at once


@pytest.mark.parametrize("missing", ["dead", "stuck"])
def test_a_member_gone_mid_chain_fails_every_member_within_the_timeout(missing: str) -> None:
    """Rank 2 of 4 never receives (stuck) or has closed its connections (dead): the
    sender, the member before it and the one after it all fail, none hangs."""
    timeout_s = 2.0
    groups = open_group(4, timeout_s=timeout_s)
    if missing == "dead":
        del groups[2]
        gc.collect()
    # 64 MiB: more than the sockets between two members hold, so a stuck member stops
    # the one before it too.
    tensors = [torch.zeros(256, 1024)] * 64
    specs = [((256, 1024), torch.float32)] * 64
    out: dict[int, Any] = {}
    receivers = [threading.Thread(target=receive_all, args=(groups[rank], specs, 1 << 20,
                                                            timeout_s, out))
                 for rank in (1, 3)]
    began = time.monotonic()
    for receiver in receivers:
        receiver.start()
    with pytest.raises(RuntimeError):
        send_buckets(groups[SENDER], tensors, 1 << 20, timeout_s)
    for receiver in receivers:
        receiver.join()
    assert sorted(out) == [1, 3]
    assert all(isinstance(err, RuntimeError) for err in out.values()), out
    assert time.monotonic() - began < 4 * timeout_s + 5
