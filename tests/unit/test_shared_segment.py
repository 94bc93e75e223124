"""Local members of a weight broadcast: the shared segment, its layout (pure), the sweep
of segments left by killed senders, the check that a version read from the segment was
not written again meanwhile (LoRA adapter versions too), and broadcasts over real gloo
groups inside one
process (a thread per rank; no Ray, no vLLM) where some members read the shared segment
and the others form the chain: every member gets every tensor exactly, the span is
measured, and a member that never receives fails the broadcast while the local members
are told at once."""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
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
from workers.weights.gloo_trainer_end import _shared
from workers.weights.gloo_transfer import GlooWeightTransferEngine
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


def dead_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_segments_of_gone_processes_are_removed_at_start_and_others_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead, prefix = dead_pid(), shared_segment.PREFIX
    files = {"orphan": f"{prefix}{dead}-0a1b", "live": f"{prefix}{os.getpid()}-0a1b",
             "held": f"{prefix}{dead}-2c3d", "other": "someone-else-123-0a1b"}
    for index, name in enumerate(files.values()):
        (tmp_path / name).write_bytes(b"x" * (1000 + index))
    # A maker alive in another pid namespace holds its file's lock.
    held = os.open(tmp_path / files["held"], os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)
    caplog.set_level(logging.INFO, logger="workers.weights.shared_segment")
    try:
        assert shared_segment.remove_orphans(tmp_path) == (1, 1000)
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        files[k] for k in ("live", "held", "other"))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "removed 1 " in line and "(1000 bytes)" in line
    assert shared_segment.remove_orphans(tmp_path) == (1, 1002)  # its lock is free now
    assert shared_segment.remove_orphans(tmp_path) == (0, 0)
    assert len(caplog.records) == 2  # nothing removed, nothing said
    assert shared_segment.remove_orphans(tmp_path / "missing") == (0, 0)


def test_a_segment_is_locked_by_its_maker_until_unlinked(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shared_segment, "ROOT", tmp_path)
    segment = SharedSegment.create(64)
    # Under a dead pid's name (its maker seen from another pid namespace): still held.
    orphan = tmp_path / f"{shared_segment.PREFIX}{dead_pid()}-0a1b"
    segment.path.rename(orphan)
    assert shared_segment.remove_orphans(tmp_path) == (0, 0) and orphan.exists()
    segment.unlink()  # its name (already gone) and its lock
    assert shared_segment.remove_orphans(tmp_path) == (1, 64 + shared_segment.HEADER)
    assert not orphan.exists()


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


ADAPTER = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
           "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]


@pytest.mark.parametrize("torn", [False, True])
def test_an_adapter_version_read_from_the_segment_is_loaded_only_whole(torn: bool) -> None:
    """An engine serving the policy as a LoRA adapter stages a version as views of the
    segment (write 1): if the segment was written again before the adapter is loaded,
    the version is refused as a full one would be, and the adapter is not loaded."""
    tensors = [torch.randn(4, 16, generator=torch.Generator().manual_seed(3)),
               torch.randn(16, 4, generator=torch.Generator().manual_seed(4))]
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    segment = segment_for(tensors)
    try:
        views = segment_views(segment, specs, BUCKET)
        for (_, view), tensor in zip(views, tensors, strict=True):
            view.copy_(tensor)
        segment.seq = 1
        engine = GlooWeightTransferEngine(
            None, SimpleNamespace(parallel_config=None, model_config=None),  # type: ignore[arg-type]
            torch.device("cpu"), torch.nn.Module())
        loaded: list[list[tuple[str, torch.Tensor]]] = []
        engine.adapter_loader = loaded.append
        engine._segment = segment
        engine._staged = [(ADAPTER[i], view) for i, view in views]
        engine._segment_write = 1
        if torn:
            segment.seq = WRITING  # the sender began the next version's write
            with pytest.raises(RuntimeError, match="written again"):
                engine.finish_weight_update()
            assert loaded == []
            return
        engine.finish_weight_update()
        (version,) = loaded
        assert [name for name, _ in version] == ADAPTER
        for _, view in views:
            view.zero_()  # the next write: what was loaded is a copy, whole
        assert all(torch.equal(got, want) for (_, got), want in zip(version, tensors,
                                                                   strict=True))
    finally:
        segment.unlink()


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
