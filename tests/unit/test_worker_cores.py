"""rollout.worker_cores' move (``workers.rollout.engine.move_own_threads``): every thread
of the process to the cores given, threads started later with them; cores it may not
use leave it where it was, with one warning naming the key."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

import pytest

from workers.rollout.engine import move_own_threads


def thread_cores() -> dict[int, set[int]]:
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}


@pytest.fixture
def restored() -> Iterator[set[int]]:
    """This process's cores, given back to every thread afterwards."""
    before = os.sched_getaffinity(0)
    yield before
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # ended since the listing
            os.sched_setaffinity(int(thread), before)


def test_every_thread_moves_and_later_threads_follow(restored: set[int]) -> None:
    target = (min(restored),)
    stop = threading.Event()
    waiting = threading.Thread(target=stop.wait)
    waiting.start()
    try:
        move_own_threads(0, target)
        moved = thread_cores()
        assert len(moved) >= 2 and all(cores == set(target) for cores in moved.values())
        seen: list[set[int]] = []
        later = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        later.start()
        later.join()
        assert seen == [set(target)]
    finally:
        stop.set()
        waiting.join()


def test_no_cores_given_moves_nothing(restored: set[int]) -> None:
    move_own_threads(0, ())
    assert all(cores == restored for cores in thread_cores().values())


def test_cores_it_may_not_use_leave_it_in_place_with_a_warning(
        restored: set[int], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        move_own_threads(3, (10_000,))
    assert os.sched_getaffinity(0) == restored
    (record,) = caplog.records
    assert "rollout worker 3: rollout.worker_cores" in record.getMessage()


def test_a_thread_that_ends_during_the_move_is_passed_over(
        restored: set[int], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    set_cores = os.sched_setaffinity
    ended = int(os.listdir("/proc/self/task")[0])

    def setaffinity(thread: int, cores: tuple[int, ...]) -> None:
        if thread == ended:
            raise ProcessLookupError(3, "No such process")
        set_cores(thread, cores)

    monkeypatch.setattr(os, "sched_setaffinity", setaffinity)
    target = (min(restored),)
    stop = threading.Event()
    waiting = threading.Thread(target=stop.wait)
    waiting.start()
    try:
        with caplog.at_level(logging.WARNING):
            move_own_threads(0, target)
        others = {t: c for t, c in thread_cores().items() if t != ended}
    finally:
        stop.set()
        waiting.join()
    assert caplog.records == []
    assert len(others) >= 1
    assert all(cores == set(target) for cores in others.values())
