"""A virtual clock: an asyncio event loop whose time jumps to its next timer.

Owns: ``VirtualClockLoop`` (the loop's ``time()`` is simulated seconds from 0; instead of
sleeping until its next timer the loop moves its clock there, so a run takes no wall
time beyond its computation and is the same every time) and ``run_virtual``, which runs
an anyio coroutine on one, with the garbage collector held back while it runs.
Everything a simulated run times (the orchestrator's durations and spans, anyio's sleeps
and deadlines, the simulated workers) reads this one clock. Knows nothing about what
runs on it.
"""

from __future__ import annotations

import asyncio
import gc
import selectors
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

YOUNG_THRESHOLD = 50_000
"""Allocations between two collections of the youngest generation during a simulation
(Python's default is 700)."""


class _JumpSelector(selectors.DefaultSelector):
    """Instead of sleeping until the next timer, moves the loop's clock to it."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise RuntimeError("simulation deadlocked: nothing is scheduled")
        self._loop.now += timeout
        # Only the loop's self-pipe is registered in a simulation (nothing does I/O on
        # the loop): skip the system call, one per loop iteration. What wakes the pipe
        # (call_soon_threadsafe) queues its callback without the pipe being read.
        return super().select(0) if len(self.get_map()) > 1 else []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on simulated time: runs take no wall time and are deterministic."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_JumpSelector(self))

    def time(self) -> float:
        return self.now


def virtual_now() -> float:
    """The running virtual loop's time (the clock a simulated run hands out)."""
    return asyncio.get_running_loop().time()


def run_virtual(main: Callable[[], Awaitable[T]]) -> T:
    """Runs ``main`` under anyio's asyncio backend on a fresh ``VirtualClockLoop``."""
    with _collector_held_back():
        return anyio.run(main, backend="asyncio",
                         backend_options={"loop_factory": VirtualClockLoop})


@contextmanager
def _collector_held_back() -> Iterator[None]:
    """A simulation makes millions of short-lived objects (futures, handles, records)
    and almost no cycles, so Python's default collector spends a good part of its CPU
    time scanning (docs/simulator-validation.md, "Speed of the simulator"). While it runs, what
    already exists (the imported modules) is frozen out of the collector's scans, unless
    the caller froze something already (unfreezing would undo that too), and the
    youngest generation is collected far less often; both are put back after."""
    threshold = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()
