"""ReplayQueue: order, bounds, backpressure, staleness drops and waits, close, snapshot,
bucketing."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
import pytest
from async_helpers import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers import (
    Dropped,
    NotEnoughGroups,
    QueueClosed,
    QueueFull,
    QueueTooSmall,
    ReplayQueue,
    ReplayQueueSnapshot,
)


class Item(msgspec.Struct, frozen=True, kw_only=True):
    """A stand-in for buffers.common.records.Group with just what the queue reads."""

    prompt_id: str
    min_version: int = 0
    num_tokens: int = 10


def item(pid: str, version: int = 0, tokens: int = 10) -> Item:
    return Item(prompt_id=pid, min_version=version, num_tokens=tokens)


def ids(items: list[Item]) -> list[str]:
    return [x.prompt_id for x in items]


def make_queue(**kw: Any) -> ReplayQueue[Item]:
    params: dict[str, Any] = {"max_groups": 8, "max_tokens": 1000, "max_staleness": 1}
    params.update(kw)
    return ReplayQueue(**params)


# -- order, buckets, statistics ---------------------------------------------------------


def test_takes_oldest_version_first_then_arrival() -> None:
    q = make_queue(max_staleness=5)
    for pid, v in [("a", 2), ("b", 1), ("c", 2), ("d", 1), ("e", 0)]:
        q.put_nowait(item(pid, v))
    assert ids(q.take_nowait(3, at_version=2)) == ["e", "b", "d"]
    assert ids(q.take_nowait(2, at_version=2)) == ["a", "c"]


def test_bucket_statistics_follow_edges() -> None:
    q = make_queue(bucket_edges=(100, 1000), max_tokens=10_000)
    for pid, tokens in [("a", 50), ("b", 100), ("c", 999), ("d", 5000)]:
        q.put_nowait(item(pid, tokens=tokens))
    stats = q.statistics()
    assert [(b.low, b.high, b.groups, b.tokens) for b in stats.buckets] == [
        (0, 100, 1, 50),
        (100, 1000, 2, 1099),
        (1000, None, 1, 5000),
    ]
    assert (stats.groups, stats.tokens, stats.put_total) == (4, 6149, 4)
    q.take_nowait(4, at_version=0)
    assert all(b.groups == 0 and b.tokens == 0 for b in q.statistics().buckets)


def test_statistics_is_a_frozen_record() -> None:
    stats = make_queue().statistics()
    with pytest.raises(AttributeError):
        stats.groups = 3  # type: ignore[misc]
    assert msgspec.json.decode(msgspec.json.encode(stats))["max_groups"] == 8


@pytest.mark.parametrize(
    "kw",
    [{"max_groups": 0}, {"max_tokens": 0}, {"max_staleness": -1}, {"bucket_edges": (10, 10)}],
)
def test_bad_config_is_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        make_queue(**kw)


def test_bad_calls_are_refused() -> None:
    q = make_queue(max_tokens=100)
    with pytest.raises(ValueError, match="max_tokens"):
        q.put_nowait(item("huge", tokens=101))
    with pytest.raises(ValueError, match="n_groups"):
        q.take_nowait(9, at_version=0)
    q.put_nowait(item("a"))
    q.take_nowait(1, at_version=1)
    with pytest.raises(ValueError, match="went back"):
        q.take_nowait(1, at_version=0)


# -- bounds and backpressure ------------------------------------------------------------


def test_put_nowait_raises_queue_full_by_groups_and_by_tokens() -> None:
    q = make_queue(max_groups=2, max_tokens=100)
    q.put_nowait(item("a", tokens=40))
    q.put_nowait(item("b", tokens=40))
    with pytest.raises(QueueFull):
        q.put_nowait(item("c", tokens=1))  # by groups
    q.take_nowait(1, at_version=0)
    with pytest.raises(QueueFull):
        q.put_nowait(item("c", tokens=61))  # by tokens
    q.put_nowait(item("c", tokens=60))
    assert ids(q.take_nowait(2, at_version=0)) == ["b", "c"]
    with pytest.raises(NotEnoughGroups):
        q.take_nowait(1, at_version=0)


@pytest.mark.asyncio
async def test_put_waits_while_full_and_resumes_after_take() -> None:
    q = make_queue(max_groups=1)
    await q.put(item("a"))
    done = anyio.Event()

    async def producer() -> None:
        await q.put(item("b"))
        done.set()

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            await wait_until(lambda: q.statistics().put_waits.waiting_now == 1)
            assert not done.is_set()
            assert ids(await q.take(1, at_version=0)) == ["a"]
            await done.wait()
    stats = q.statistics()
    assert stats.put_waits.count == 1 and stats.put_waits.seconds > 0
    assert ids(q.drain()) == ["b"]


@pytest.mark.asyncio
async def test_take_waits_until_enough_groups() -> None:
    q = make_queue()
    got: list[str] = []

    async def consumer() -> None:
        got.extend(ids(await q.take(3, at_version=0)))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            for pid in "abc":
                await wait_until(lambda: q.statistics().take_waits.waiting_now == 1)
                await q.put(item(pid))
    assert got == ["a", "b", "c"]
    assert q.statistics().take_waits.count == 1


@pytest.mark.asyncio
async def test_putters_are_served_in_order() -> None:
    q = make_queue(max_groups=8, max_tokens=100)
    await q.put(item("full", tokens=100))
    order: list[str] = []

    async def producer(pid: str, tokens: int) -> None:
        await q.put(item(pid, tokens=tokens))
        order.append(pid)

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer, "big", 90)
            await wait_until(lambda: q.statistics().put_waits.waiting_now == 1)
            tg.start_soon(producer, "small", 5)  # would fit after any take; must not jump
            await wait_until(lambda: q.statistics().put_waits.waiting_now == 2)
            await q.take(1, at_version=0)
    assert order == ["big", "small"]


@pytest.mark.asyncio
@pytest.mark.parametrize("woken_first", [False, True])
async def test_cancelled_put_passes_its_turn_on(woken_first: bool) -> None:
    q = make_queue(max_groups=1)
    await q.put(item("a"))
    scope = anyio.CancelScope()

    async def put_b() -> None:
        with scope:
            await q.put(item("b"))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(put_b)
            await wait_until(lambda: q.statistics().put_waits.waiting_now == 1)
            tg.start_soon(q.put, item("c"))
            await wait_until(lambda: q.statistics().put_waits.waiting_now == 2)
            if woken_first:
                # b is handed the room, then cancelled before it runs: depending on the
                # backend it either completes (the put had succeeded) or passes the room
                # on to c. Either way nothing is lost and c gets in.
                assert ids(q.take_nowait(1, at_version=0)) == ["a"]
                scope.cancel()
                got = ids(await q.take(1, at_version=0))
                if got == ["b"]:
                    got = ids(await q.take(1, at_version=0))
                assert got == ["c"]
            else:
                scope.cancel()
                await wait_until(lambda: q.statistics().put_waits.waiting_now == 1)
                assert ids(await q.take(1, at_version=0)) == ["a"]
                assert ids(await q.take(1, at_version=0)) == ["c"]
    stats = q.statistics()
    assert stats.put_total == stats.taken_total and len(q) == 0


@pytest.mark.asyncio
async def test_impossible_take_raises_instead_of_hanging() -> None:
    q = make_queue(max_groups=8, max_tokens=100)

    async def put_b() -> None:
        with pytest.raises(QueueClosed):
            await q.put(item("b", tokens=60))  # parks: 120 > 100

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            await q.put(item("a", tokens=60))
            tg.start_soon(put_b)
            await wait_until(lambda: q.statistics().put_waits.waiting_now == 1)
            with pytest.raises(QueueTooSmall, match="max_tokens=100"):
                await q.take(2, at_version=0)
            q.close()


# -- staleness --------------------------------------------------------------------------


def test_take_drops_stale_groups_and_hands_them_back() -> None:
    dropped: list[Dropped[Item]] = []
    q = make_queue(max_staleness=1, on_drop=dropped.append)
    for pid, v in [("v0", 0), ("v1", 1), ("v2", 2), ("v3", 3)]:
        q.put_nowait(item(pid, v))
    assert ids(q.take_nowait(2, at_version=3)) == ["v2", "v3"]
    assert [(d.prompt_id, d.reason, d.min_version, d.at_version) for d in dropped] == [
        ("v0", "stale", 0, 3),
        ("v1", "stale", 1, 3),
    ]
    stats = q.statistics()
    assert stats.drops == {"stale": 2}
    assert stats.staleness_taken == (1, 1)  # v3 at staleness 0, v2 at staleness 1
    assert stats.put_total == stats.taken_total + stats.drops["stale"] + stats.groups


def test_drops_are_kept_without_a_handler() -> None:
    q = make_queue(max_staleness=0)
    q.put_nowait(item("old", 0))
    q.put_nowait(item("new", 1))
    assert ids(q.take_nowait(1, at_version=1)) == ["new"]
    assert [d.prompt_id for d in q.drain_dropped()] == ["old"]
    assert q.drain_dropped() == []


def test_group_already_stale_on_arrival_is_dropped_at_once() -> None:
    dropped: list[Dropped[Item]] = []
    q = make_queue(max_staleness=0, on_drop=dropped.append)
    q.put_nowait(item("a", 5))
    q.take_nowait(1, at_version=5)
    q.put_nowait(item("late", 4))
    assert len(q) == 0 and [d.prompt_id for d in dropped] == ["late"]


@pytest.mark.asyncio
async def test_stale_arrival_is_handed_back_while_a_taker_waits() -> None:
    # The gate-deadlock case: the trainer waits for groups; a stale one must come back
    # now (so its prompt is re-run and its admission slot freed), not at the next take.
    dropped: list[str] = []
    q = make_queue(max_staleness=0, on_drop=lambda d: dropped.append(d.prompt_id))
    got: list[str] = []

    async def trainer() -> None:
        got.extend(ids(await q.take(1, at_version=3)))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            await wait_until(lambda: q.statistics().take_waits.waiting_now == 1)
            await q.put(item("slow", 2))
            assert dropped == ["slow"]
            await q.put(item("retry", 3))
    assert got == ["retry"]


@pytest.mark.asyncio
async def test_parked_putter_with_a_now_stale_group_is_dropped() -> None:
    dropped: list[str] = []
    q = make_queue(max_groups=1, max_staleness=0, on_drop=lambda d: dropped.append(d.prompt_id))
    await q.put(item("a", 0))
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(q.put, item("b", 0))
            await wait_until(lambda: q.statistics().put_waits.waiting_now == 1)
            assert ids(await q.take(1, at_version=0)) == ["a"]  # b moves in
            await wait_until(lambda: len(q) == 1)
            tg.start_soon(q.put, item("c", 0))
            await wait_until(lambda: q.statistics().put_waits.count == 2)
            with pytest.raises(NotEnoughGroups):
                q.take_nowait(1, at_version=1)  # b is dropped, c is now stale too
            await wait_until(lambda: q.statistics().put_waits.waiting_now == 0)
    assert dropped == ["b", "c"] and len(q) == 0


def test_drops_are_counted_by_length_bucket() -> None:
    q = make_queue(max_staleness=0, bucket_edges=(100,), max_tokens=10_000)
    for pid, v, t in [("s0", 0, 50), ("l0", 0, 500), ("l1", 1, 500), ("s1", 1, 60)]:
        q.put_nowait(item(pid, v, t))
    assert ids(q.take_nowait(1, at_version=1)) == ["l1"]  # s0 and l0 dropped
    q.put_nowait(item("l2", 0, 400))  # too stale on arrival
    buckets = q.statistics().buckets
    assert [(b.low, b.high, b.put_total, b.dropped) for b in buckets] == [
        (0, 100, 2, 1),
        (100, None, 3, 2),
    ]
    assert sum(b.dropped for b in buckets) == q.statistics().drops["stale"]


# -- waiting for groups only this take may train ----------------------------------------


@pytest.mark.parametrize("wait_for_expiring", [True, False])
@pytest.mark.asyncio
async def test_an_expiring_long_group_is_taken_ahead_of_newer_short_ones(
    wait_for_expiring: bool,
) -> None:
    """A long group started at version 0 is still generating when the trainer takes at
    version 1 = its last chance (max_staleness 1). With the wait it is trained ahead of
    the newer short groups; without it the short ones go and it is dropped later."""
    dropped: list[str] = []
    q = make_queue(max_staleness=1, bucket_edges=(100,), wait_for_expiring=wait_for_expiring,
                   on_drop=lambda d: dropped.append(d.prompt_id))
    got: list[list[str]] = []

    async def trainer(version: int, n: int) -> None:
        got.append(ids(await q.take(n, at_version=version)))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            with q.expecting(0):
                q.put_nowait(item("s1", 1, 50))
                q.put_nowait(item("s2", 1, 60))
                tg.start_soon(trainer, 1, 2)
                await anyio.sleep(0.01)  # the trainer runs while the long group generates
                assert got == ([] if wait_for_expiring else [["s1", "s2"]])
            await q.put(item("long", 0, 500))
            await wait_until(lambda: len(got) == 1)
            q.put_nowait(item("s3", 2, 50))
            tg.start_soon(trainer, 2, 1)
    if wait_for_expiring:
        assert got == [["long", "s1"], ["s2"]] and dropped == []
    else:
        assert got == [["s1", "s2"], ["s3"]] and dropped == ["long"]
        assert q.statistics().buckets[1].dropped == 1  # the long bucket's drop rate


def test_a_take_does_not_wait_for_groups_a_later_take_may_train() -> None:
    q = make_queue(max_staleness=1)
    q.put_nowait(item("a", 1))
    with q.expecting(1):  # trainable at version 2 too
        assert ids(q.take_nowait(1, at_version=1)) == ["a"]
    q.put_nowait(item("b", 1))
    with q.expecting(0), pytest.raises(NotEnoughGroups):  # only this take may train it
        q.take_nowait(1, at_version=1)
    assert ids(q.take_nowait(1, at_version=1)) == ["b"]


@pytest.mark.asyncio
async def test_a_failed_generation_ends_the_wait() -> None:
    q = make_queue(max_staleness=1)
    q.put_nowait(item("a", 1))
    got: list[str] = []

    async def trainer() -> None:
        got.extend(ids(await q.take(1, at_version=1)))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            with pytest.raises(RuntimeError), q.expecting(0):
                tg.start_soon(trainer)
                await wait_until(lambda: q.statistics().take_waits.waiting_now == 1)
                raise RuntimeError("the rollout worker died")
    assert got == ["a"]


@pytest.mark.asyncio
async def test_a_group_waiting_for_room_is_not_waited_for() -> None:
    """The take is what makes room, so waiting for a parked putter would deadlock."""
    q = make_queue(max_groups=2, max_staleness=1)
    q.put_nowait(item("a", 1))
    q.put_nowait(item("b", 1))
    got: list[str] = []

    async def trainer() -> None:
        got.extend(ids(await q.take(2, at_version=1)))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            with q.expecting(0):
                tg.start_soon(trainer)
                await wait_until(lambda: q.statistics().take_waits.waiting_now == 1)
            tg.start_soon(q.put, item("late", 0))  # full: parks, and the take goes on
    assert got == ["a", "b"] and ids(q.drain()) == ["late"]


# -- close, snapshot --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_close_releases_waiters_with_queue_closed() -> None:
    # A putter and a taker cannot both wait on one queue (that is QueueTooSmall), so
    # one queue holds a parked putter and another a parked taker.
    full, empty = make_queue(max_groups=1), make_queue()
    await full.put(item("a"))
    outcomes: list[str] = []

    async def run(coro_fn: Callable[[], Awaitable[object]]) -> None:
        try:
            await coro_fn()
        except QueueClosed:
            outcomes.append("closed")

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, lambda: full.put(item("b")))
            tg.start_soon(run, lambda: empty.take(2, at_version=0))
            await wait_until(lambda: full.statistics().put_waits.waiting_now == 1)
            await wait_until(lambda: empty.statistics().take_waits.waiting_now == 1)
            full.close()
            empty.close()
    assert outcomes == ["closed", "closed"]
    with pytest.raises(QueueClosed):
        await full.put(item("c"))
    with pytest.raises(QueueClosed):
        await empty.take(1, at_version=0)
    assert ids(await full.take(1, at_version=0)) == ["a"]  # what can be served still is
    assert full.statistics().closed


def test_snapshot_round_trips_through_msgpack() -> None:
    q = make_queue(bucket_edges=(20,), max_staleness=2)
    for pid, v, t in [("a", 1, 10), ("b", 0, 30), ("c", 1, 5), ("d", 2, 25)]:
        q.put_nowait(item(pid, v, t))
    q.take_nowait(1, at_version=3)  # drops b (bucket 1), takes a at staleness 2
    q.put_nowait(item("late", 0, 40))  # dropped on arrival, also in bucket 1
    raw = msgspec.msgpack.encode(q.snapshot())
    snap = msgspec.msgpack.decode(raw, type=ReplayQueueSnapshot[Item])
    restored = make_queue(bucket_edges=(20,), max_staleness=2)
    restored.restore(snap)
    assert restored.statistics() == q.statistics()
    assert [(b.put_total, b.dropped) for b in restored.statistics().buckets] == [(2, 0), (3, 2)]
    assert ids(restored.drain()) == ids(q.drain()) == ["c", "d"]
    with pytest.raises(RuntimeError):
        restored.restore(snap)


def test_restore_with_other_bucket_edges_restarts_the_per_bucket_counts() -> None:
    q = make_queue(bucket_edges=(20,), max_staleness=0)
    q.put_nowait(item("old", 0, 30))
    with pytest.raises(NotEnoughGroups):
        q.take_nowait(1, at_version=1)  # drops "old"
    restored = make_queue(bucket_edges=(50,), max_staleness=0)
    restored.restore(q.snapshot())
    stats = restored.statistics()
    assert stats.drops == {"stale": 1} and stats.put_total == 1
    assert [(b.put_total, b.dropped) for b in stats.buckets] == [(0, 0), (0, 0)]


def test_readmit_queues_the_admissible_and_drops_the_stale_at_the_resumed_version() -> None:
    """A checkpoint's groups back in a new queue at version 5, max_staleness 1: those of
    versions 4 and 5 are queued (beyond max_groups too) with their entry versions, the
    one of version 3 is dropped as a take at 5 would, through on_drop."""
    dropped: list[Dropped[Item]] = []
    q = make_queue(max_groups=2, on_drop=dropped.append)
    q.readmit([item("old", 3), item("a", 4), item("b", 5), item("c", 4)], [3, 4, 5, None],
              at_version=5)
    assert [(d.item.prompt_id, d.reason) for d in dropped] == [("old", "stale")]
    stats = q.statistics()
    assert (stats.groups, stats.put_total, stats.drops, stats.sink_version) == (
        3, 4, {"stale": 1}, 5)
    taken = q.take_nowait(2, at_version=5)
    assert ids(taken) == ["a", "c"]
    with pytest.raises(RuntimeError, match="new, empty queue"):
        q.readmit([item("d", 5)], [5], at_version=5)
    assert ids(q.take_nowait(1, at_version=6)) == ["b"]
    assert make_queue().readmit([], [], at_version=0) is None  # nothing kept: a no-op


# -- homogeneous takes ------------------------------------------------------------------


def test_homogeneous_take_fills_from_the_oldest_groups_bucket() -> None:
    q = make_queue(bucket_edges=(100,), max_staleness=2, max_tokens=10_000)
    for pid, v, t in [("s0", 0, 50), ("l0", 0, 500), ("l1", 1, 500), ("s1", 1, 60)]:
        q.put_nowait(item(pid, v, t))
    # At version 1 nothing is urgent (would be stale at 2 only past staleness 2).
    assert ids(q.take_nowait(2, at_version=1, homogeneous=True)) == ["s0", "s1"]
    assert ids(q.take_nowait(2, at_version=1, homogeneous=True)) == ["l0", "l1"]


def test_homogeneous_take_never_leaves_a_group_to_go_stale() -> None:
    q = make_queue(bucket_edges=(100,), max_staleness=1, max_tokens=10_000)
    for pid, v, t in [("s0", 1, 50), ("l0", 0, 500), ("s1", 1, 60), ("s2", 1, 70)]:
        q.put_nowait(item(pid, v, t))
    # l0 is at staleness 1 = max: it would be dropped at version 2, so it goes now.
    assert ids(q.take_nowait(2, at_version=1, homogeneous=True)) == ["l0", "s0"]


def test_homogeneous_with_zero_staleness_is_oldest_first() -> None:
    q = make_queue(bucket_edges=(100,), max_staleness=0, max_tokens=10_000)
    for pid, t in [("l0", 500), ("s0", 50), ("l1", 500)]:
        q.put_nowait(item(pid, 0, t))
    assert ids(q.take_nowait(2, at_version=0, homogeneous=True)) == ["l0", "s0"]


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300)), min_size=1, max_size=40),
    n=st.integers(1, 10),
    max_staleness=st.integers(1, 3),
)
def test_homogeneous_take_keeps_the_oldest_first_bound(
    groups: list[tuple[int, int]], n: int, max_staleness: int
) -> None:
    at_version = 4
    q = make_queue(
        max_groups=64, max_tokens=100_000, max_staleness=max_staleness, bucket_edges=(50, 150)
    )
    for i, (age, tokens) in enumerate(groups):
        q.put_nowait(item(f"p{i}", at_version - min(age, max_staleness), tokens))
    versions = [at_version - min(age, max_staleness) for age, _ in groups]
    fifo = sorted(range(len(groups)), key=lambda i: (versions[i], i))
    n = min(n, len(groups))
    taken = ids(q.take_nowait(n, at_version, homogeneous=True))
    assert len(taken) == n and f"p{fifo[0]}" in taken  # the oldest group always goes
    # Every group that would be too stale at the next version goes now (up to n).
    urgent = [f"p{i}" for i in fifo if at_version + 1 - versions[i] > max_staleness]
    assert set(urgent[:n]) <= set(taken)


# -- properties -------------------------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 3), st.integers(1, 60)),
        st.tuples(st.just("take"), st.integers(1, 4), st.integers(0, 2)),
        st.tuples(st.just("homogeneous"), st.integers(1, 4), st.integers(0, 2)),
        st.tuples(st.just("close"), st.just(0), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, max_staleness=st.integers(0, 2), max_groups=st.integers(4, 6))
def test_no_group_is_lost_or_duplicated(
    ops: list[tuple[str, int, int]], max_staleness: int, max_groups: int
) -> None:
    dropped: list[Dropped[Item]] = []
    q = make_queue(
        max_groups=max_groups,
        max_tokens=120,
        max_staleness=max_staleness,
        bucket_edges=(20, 40),
        on_drop=dropped.append,
    )
    version, accepted, taken = 0, [], []
    counter = itertools.count()
    for op, a, b in ops:
        if op == "put":
            x = item(f"p{next(counter)}", max(0, version - a), b)
            try:
                q.put_nowait(x)
                accepted.append(x.prompt_id)
            except (QueueFull, QueueClosed):
                pass
        elif op == "close":
            q.close()
        else:
            version += b
            try:
                batch = q.take_nowait(a, version, homogeneous=op == "homogeneous")
            except (NotEnoughGroups, QueueClosed):
                continue
            assert len(batch) == a
            assert all(version - x.min_version <= max_staleness for x in batch)
            taken.extend(ids(batch))
    rest = ids(q.drain())
    everything = taken + [d.prompt_id for d in dropped] + rest
    assert sorted(everything) == sorted(accepted)
    assert len(set(everything)) == len(everything)
    stats = q.statistics()
    assert stats.put_total == len(accepted) and stats.groups == 0 and stats.tokens == 0
    assert sum(stats.staleness_taken) == stats.taken_total == len(taken)


@settings(max_examples=25, deadline=None)
@given(
    lags=st.lists(st.integers(0, 4), min_size=1, max_size=24),
    max_staleness=st.integers(0, 2),
    max_groups=st.integers(1, 5),
    batch=st.integers(1, 5),
    homogeneous=st.booleans(),
)
def test_every_prompt_trains_exactly_once_with_requeues(
    lags: list[int], max_staleness: int, max_groups: int, batch: int, homogeneous: bool
) -> None:
    """Producer and trainer run concurrently; drops are re-queued as fresh attempts."""
    batch = min(batch, max_groups)
    n = len(lags)
    pending: deque[tuple[str, int]] = deque((f"p{i}", lag) for i, lag in enumerate(lags))
    trained: list[str] = []
    clock = {"version": 0}
    wake = [anyio.Event()]

    def requeue(d: Dropped[Item]) -> None:
        pending.append((d.prompt_id, 0))  # a retry starts at the current version
        wake[0].set()

    q = ReplayQueue[Item](
        max_groups=max_groups,
        max_tokens=10_000,
        max_staleness=max_staleness,
        bucket_edges=(30,),
        on_drop=requeue,
    )

    async def producer() -> None:
        while len(trained) < n:
            if not pending:
                wake[0] = anyio.Event()
                await wake[0].wait()
                continue
            pid, lag = pending.popleft()
            try:
                await q.put(item(pid, max(0, clock["version"] - lag), 10 + 7 * len(pid)))
            except QueueClosed:
                return

    async def trainer() -> None:
        while len(trained) < n:
            version = clock["version"]
            got = await q.take(min(batch, n - len(trained)), version, homogeneous=homogeneous)
            assert all(version - x.min_version <= max_staleness for x in got)
            trained.extend(ids(got))
            clock["version"] = version + 1
        q.close()
        wake[0].set()

    async def main() -> None:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(producer)
                tg.start_soon(trainer)

    anyio.run(main)
    assert sorted(trained) == sorted(f"p{i}" for i in range(n))
    stats = q.statistics()
    assert stats.put_total == stats.taken_total + stats.drops.get("stale", 0)
