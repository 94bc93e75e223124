"""Bucketed tensor transfer: the plan (pure), and a round trip over a real two-rank gloo
group inside one process (no Ray, no vLLM)."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from workers.weights.bucket_transfer import (
    ALIGN,
    RECEIVER,
    SENDER,
    Bucket,
    host_store,
    join_store,
    pair_group,
    plan_buckets,
    receive_buckets,
    send_buckets,
)


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


def open_pair(timeout_s: float) -> dict[int, torch.distributed.ProcessGroupGloo]:
    """Both ends of a pair group, in this process (each end joins on its own thread)."""
    store = host_store("127.0.0.1", timeout_s=timeout_s)
    groups: dict[int, torch.distributed.ProcessGroupGloo] = {}

    def join(rank: int) -> None:
        peer = (store if rank == SENDER
                else join_store("127.0.0.1", store.port, timeout_s=timeout_s))
        groups[rank] = pair_group(peer, rank, timeout_s=timeout_s)

    joiner = threading.Thread(target=join, args=(RECEIVER,))
    joiner.start()
    join(SENDER)
    joiner.join()
    return groups


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
