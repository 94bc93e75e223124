"""Local members of a weight broadcast: the shared segment, its layout (pure), and
broadcasts over real gloo groups inside one process (a thread per rank; no Ray, no
vLLM) where some members read the shared segment and the others form the chain: every
member gets every tensor exactly, the span is measured, and a member that never
receives fails the broadcast while the local members are told at once."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_bucket_transfer import open_group

from workers.weights import shared_segment
from workers.weights.bucket_plan import ALIGN, plan_buckets, segment_layout
from workers.weights.bucket_transfer import (
    ABORTED,
    SENDER,
    receive_buckets,
    receive_local,
    segment_views,
    send_buckets,
)
from workers.weights.gloo_transfer import _shared
from workers.weights.shared_segment import WRITING, SharedSegment


@given(st.lists(st.integers(0, 5000), max_size=40), st.integers(ALIGN, 4096))
def test_every_tensor_is_one_aligned_run_of_the_segment(sizes: list[int],
                                                        bucket_bytes: int) -> None:
    plan = plan_buckets(sizes, bucket_bytes)
    offsets, total = segment_layout(plan)
    assert len(offsets) == len(plan)
    runs: dict[int, list[tuple[int, int]]] = {}
    for bucket, offset in zip(plan, offsets, strict=True):
        for p in bucket.pieces:
            runs.setdefault(p.tensor, []).append((offset + p.offset, p.nbytes))
    assert sorted(runs) == list(range(len(sizes)))
    spans = []
    for index, pieces in runs.items():
        start = pieces[0][0]
        assert start % ALIGN == 0
        # The pieces of a split tensor follow each other: one run, the tensor's size.
        assert [s for s, _ in pieces] == [start + sum(n for _, n in pieces[:k])
                                          for k in range(len(pieces))]
        spans.append((start, start + sizes[index]))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert all(end <= total for _, end in spans)


def test_a_segment_is_seen_by_its_token_only(tmp_path: Path) -> None:
    segment = SharedSegment.create(128)
    try:
        assert segment.seq == WRITING and segment.nbytes == 128
        other = SharedSegment.open(str(segment.path), 128, segment.token.hex())
        assert other is not None
        segment.data[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        segment.seq = 7
        assert other.data[:4].tolist() == [1, 2, 3, 4] and other.seq == 7
        assert SharedSegment.open(str(segment.path), 128, "00" * 16) is None  # not ours
        assert SharedSegment.open(str(segment.path), 64, segment.token.hex()) is None
        assert SharedSegment.open(str(tmp_path / "none"), 128, segment.token.hex()) is None
    finally:
        segment.unlink()
    assert not segment.path.exists()
    assert segment.data[:4].tolist() == [1, 2, 3, 4]  # still mapped


def test_no_room_in_shared_memory_falls_back_to_the_chain(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shared_segment, "ROOT", tmp_path / "missing")
    assert _shared(1024) is None


TENSORS = [torch.randn(40, 30, generator=torch.Generator().manual_seed(2)),  # split
           torch.arange(9, dtype=torch.int64), torch.zeros(0, 3),           # empty
           torch.tensor(2.5).to(torch.bfloat16)]                            # 0-dim
SPECS = [(tuple(t.shape), t.dtype) for t in TENSORS]
BUCKET = 1024


def segment_for(tensors: list[torch.Tensor]) -> SharedSegment:
    sizes = [t.numel() * t.element_size() for t in tensors]
    return SharedSegment.create(segment_layout(plan_buckets(sizes, BUCKET))[1])


def local_member(group: Any, segment: SharedSegment, timeout_s: float,
                 out: dict[int, Any]) -> None:
    mine = SharedSegment.open(str(segment.path), segment.nbytes, segment.token.hex())
    assert mine is not None
    try:
        out[group.rank()] = receive_local(group, mine, SPECS, BUCKET, timeout_s)
    except RuntimeError as err:
        out[group.rank()] = (err, time.monotonic())


def chain_member(group: Any, chain: list[int], timeout_s: float, out: dict[int, Any]) -> None:
    try:
        batches = list(receive_buckets(group, SPECS, BUCKET, timeout_s, chain))
        out[group.rank()] = (0, [pair for batch in batches for pair in batch])
    except RuntimeError as err:
        out[group.rank()] = (err, time.monotonic())


@pytest.mark.parametrize(("size", "local"), [(2, [1]), (5, [1, 2, 3, 4]), (5, [2, 4]),
                                             (4, [])])
def test_local_and_chain_members_all_get_every_tensor(size: int, local: list[int]) -> None:
    groups = open_group(size, timeout_s=30)
    segment = segment_for(TENSORS)
    chain = [rank for rank in range(1, size) if rank not in local]
    out: dict[int, Any] = {}
    threads = [threading.Thread(target=local_member, args=(groups[r], segment, 30.0, out))
               for r in local]
    threads += [threading.Thread(target=chain_member, args=(groups[r], chain, 30.0, out))
                for r in chain]
    for thread in threads:
        thread.start()
    try:
        began = time.time()
        start, end = send_buckets(groups[SENDER], TENSORS, BUCKET, 30.0, local=local,
                                  segment=segment)
        assert began <= start <= end <= time.time()
        for thread in threads:
            thread.join()
    finally:
        segment.unlink()
    assert sorted(out) == list(range(1, size))
    for rank, (write, pairs) in out.items():
        assert isinstance(write, int), f"rank {rank}: {write!r}"
        assert write == (1 if rank in local else 0)
        assert [i for i, _ in pairs] == list(range(len(TENSORS)))
        for (_, got), want in zip(pairs, TENSORS, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    if local:
        assert segment.seq == 1  # the write's number, rung to every local member


def test_the_segment_is_written_again_for_the_next_broadcast_only() -> None:
    groups = open_group(2, timeout_s=30)
    segment = segment_for(TENSORS)
    try:
        for number, shift in [(1, 0.0), (2, 1.0)]:
            out: dict[int, Any] = {}
            tensors = [t + shift if t.is_floating_point() else t for t in TENSORS]
            reader = threading.Thread(target=local_member, args=(groups[1], segment, 30.0,
                                                                 out))
            reader.start()
            send_buckets(groups[SENDER], tensors, BUCKET, 30.0, local=[1], segment=segment)
            reader.join()
            write, pairs = out[1]
            assert write == number == segment.seq
            assert torch.equal(pairs[0][1], tensors[0])
        views = segment_views(segment, SPECS, BUCKET)
        assert torch.equal(views[0][1], TENSORS[0] + 1.0)
    finally:
        segment.unlink()


def test_local_members_need_a_segment() -> None:
    groups = open_group(2, timeout_s=5)
    with pytest.raises(ValueError, match="segment"):
        send_buckets(groups[SENDER], TENSORS, BUCKET, 5.0, local=[1])


@pytest.mark.parametrize("missing", ["dead", "stuck"])
def test_a_member_gone_fails_the_broadcast_and_local_members_are_told_at_once(
        missing: str) -> None:
    """Rank 3 (local) has closed its connections (dead) or never calls its receive
    (stuck): the sender gives up (at once, or at the deadline), and the local member
    that waits (rank 1, with a deadline of its own far off) fails at once after it: told
    by the sender (dead), or by gloo closing the timed-out sender's connections (stuck).
    The chain member (rank 2) fails too. Nothing hangs, nothing is written."""
    import gc

    timeout_s = 2.0
    groups = open_group(4, timeout_s=timeout_s)
    if missing == "dead":
        del groups[3]
        gc.collect()
    segment = segment_for(TENSORS)
    out: dict[int, Any] = {}
    threads = [threading.Thread(target=local_member, args=(groups[1], segment, 60.0, out)),
               threading.Thread(target=chain_member, args=(groups[2], [2], timeout_s, out))]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        with pytest.raises(RuntimeError):
            send_buckets(groups[SENDER], TENSORS, BUCKET, timeout_s, local=[1, 3],
                         segment=segment)
        gave_up = time.monotonic()
        for thread in threads:
            thread.join()
    finally:
        segment.unlink()
    assert gave_up - began < (1 if missing == "dead" else timeout_s + 2)
    assert sorted(out) == [1, 2]
    (local_err, local_at), (chain_err, _) = out[1], out[2]
    assert isinstance(local_err, RuntimeError) and isinstance(chain_err, RuntimeError)
    if missing == "dead":
        assert "gave the broadcast up" in str(local_err)
    assert local_at - gave_up < 1.5  # its own deadline is 60 s: it was told
    assert segment.seq == ABORTED  # nothing was written; the polling members see it
