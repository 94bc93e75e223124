"""AdmissionGate: AReaL's rule, waiting and hand-off, give-backs, snapshot; gate + queue."""

from __future__ import annotations

import anyio
import anyio.abc
import msgspec
import pytest
from async_helpers import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers import AdmissionGate, Dropped, GateShutDown, GateSnapshot, ReplayQueue


class Item(msgspec.Struct, frozen=True, kw_only=True):
    prompt_id: str
    min_version: int
    num_tokens: int = 10


def admitted_now(gate: AdmissionGate) -> int:
    n = 0
    while gate.try_acquire():
        n += 1
    return n


def test_zero_staleness_admits_exactly_one_step_per_version() -> None:
    gate = AdmissionGate(groups_per_step=4, max_staleness=0)
    assert admitted_now(gate) == 4
    for version in range(1, 5):
        gate.on_version(version)
        assert admitted_now(gate) == 4
    assert gate.started == 20 == gate.limit


def test_limit_follows_areal_rule() -> None:
    gate = AdmissionGate(groups_per_step=3, max_staleness=2)
    assert gate.limit == (0 + 2 + 1) * 3 == gate.open_slots
    assert admitted_now(gate) == 9 and gate.open_slots == 0
    gate.on_version(2)
    assert gate.limit == 15 and gate.open_slots == 6


def test_release_gives_a_slot_back() -> None:
    gate = AdmissionGate(groups_per_step=2, max_staleness=0)
    assert admitted_now(gate) == 2
    gate.release()
    assert gate.open_slots == 1 and gate.try_acquire() and not gate.try_acquire()
    stats = gate.statistics()
    assert (stats.admitted_total, stats.released_total, stats.started) == (3, 1, 2)


def test_bad_calls_are_refused() -> None:
    with pytest.raises(ValueError):
        AdmissionGate(groups_per_step=0, max_staleness=0)
    with pytest.raises(ValueError):
        AdmissionGate(groups_per_step=1, max_staleness=-1)
    gate = AdmissionGate(groups_per_step=1, max_staleness=0, version=3)
    with pytest.raises(ValueError, match="went back"):
        gate.on_version(2)
    with pytest.raises(ValueError, match="release"):
        gate.release()


@pytest.mark.asyncio
async def test_acquire_waits_while_shut_and_on_version_opens_it_in_order() -> None:
    gate = AdmissionGate(groups_per_step=2, max_staleness=0)
    assert admitted_now(gate) == 2
    order: list[int] = []

    async def rollout(i: int) -> None:
        await gate.acquire()
        order.append(i)

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(rollout, i)
                await wait_until(lambda i=i: gate.statistics().waiting_now == i + 1)
            assert not gate.try_acquire()  # waiters come first
            gate.on_version(1)  # two slots: handed to the first two waiters
            await wait_until(lambda: len(order) == 2)
            assert gate.statistics().waiting_now == 1
            gate.release()  # a failed start: its slot goes to the last waiter
    assert order == [0, 1, 2]
    stats = gate.statistics()
    assert stats.waits == 3 and stats.wait_seconds > 0 and stats.started == 4


@pytest.mark.asyncio
async def test_cancelled_wait_leaks_no_slot() -> None:
    gate = AdmissionGate(groups_per_step=1, max_staleness=0)
    assert admitted_now(gate) == 1
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(gate.acquire)
            await wait_until(lambda: gate.statistics().waiting_now == 1)
            tg.cancel_scope.cancel()
    assert gate.statistics().waiting_now == 0
    gate.on_version(1)
    assert gate.try_acquire() and gate.started == 2


@pytest.mark.asyncio
async def test_shut_down_wakes_waiters() -> None:
    gate = AdmissionGate(groups_per_step=1, max_staleness=0)
    assert admitted_now(gate) == 1
    failures: list[str] = []

    async def rollout() -> None:
        try:
            await gate.acquire()
        except GateShutDown:
            failures.append("shut")

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rollout)
            await wait_until(lambda: gate.statistics().waiting_now == 1)
            gate.shut_down()
    assert failures == ["shut"]
    with pytest.raises(GateShutDown):
        gate.try_acquire()
    with pytest.raises(GateShutDown):
        await gate.acquire()
    assert gate.statistics().shut_down


def test_snapshot_restores_the_counters() -> None:
    gate = AdmissionGate(groups_per_step=4, max_staleness=1)
    gate.on_version(3)
    admitted = admitted_now(gate)
    gate.release(2)
    raw = msgspec.msgpack.encode(gate.snapshot(in_flight=3))
    snap = msgspec.msgpack.decode(raw, type=GateSnapshot)
    resumed = AdmissionGate(groups_per_step=4, max_staleness=1)
    resumed.restore(snap)
    # The 3 in-flight prompts (lost with the process) plus the 2 released can start again.
    assert (resumed.version, resumed.started) == (3, admitted - 5)
    assert admitted_now(resumed) == 5
    with pytest.raises(RuntimeError):
        resumed.restore(snap)


@settings(max_examples=100, deadline=None)
@given(
    groups_per_step=st.integers(1, 5),
    max_staleness=st.integers(0, 3),
    ops=st.lists(st.sampled_from(["acquire", "release", "step"]), max_size=60),
)
def test_started_never_exceeds_the_bound(
    groups_per_step: int, max_staleness: int, ops: list[str]
) -> None:
    gate = AdmissionGate(groups_per_step=groups_per_step, max_staleness=max_staleness)
    for op in ops:
        if op == "acquire":
            opened = gate.open_slots
            assert gate.try_acquire() == (opened > 0)
        elif op == "release" and gate.started:
            gate.release()
        elif op == "step":
            gate.on_version(gate.version + 1)
        stats = gate.statistics()
        assert stats.started <= (gate.version + max_staleness + 1) * groups_per_step
        assert stats.started == stats.admitted_total - stats.released_total


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=4, max_size=30),
    groups_per_step=st.integers(1, 4),
    max_staleness=st.integers(0, 2),
)
def test_gate_and_queue_drop_nothing_when_takes_wait_for_expiring_groups(
    lengths: list[int], groups_per_step: int, max_staleness: int
) -> None:
    """Rollout as the orchestrator runs it: a prompt starts once the gate admits it and
    its group takes ``length`` loop turns to generate, so groups finish out of order.
    Each take waits for the groups only it may train: none is dropped, none is trained
    beyond the bound, and every step fills."""
    steps = len(lengths) // groups_per_step
    gate = AdmissionGate(groups_per_step=groups_per_step, max_staleness=max_staleness)
    dropped: list[Dropped[Item]] = []
    queue = ReplayQueue[Item](max_groups=64, max_tokens=10_000, max_staleness=max_staleness,
                              on_drop=dropped.append)
    trained: list[Item] = []

    async def generate(i: int) -> None:
        version = gate.version
        with queue.expecting(version):
            for _ in range(lengths[i]):
                await anyio.sleep(0)
        await queue.put(Item(prompt_id=f"p{i}", min_version=version))

    async def rollout(generations: anyio.abc.TaskGroup) -> None:
        for i in range(len(lengths)):
            await gate.acquire()
            generations.start_soon(generate, i)

    async def main() -> None:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(rollout, tg)
                for version in range(steps):
                    got = await queue.take(groups_per_step, at_version=version)
                    assert all(version - x.min_version <= max_staleness for x in got)
                    trained.extend(got)
                    gate.on_version(version + 1)
                tg.cancel_scope.cancel()

    anyio.run(main)
    assert not dropped and len(trained) == steps * groups_per_step
