"""Sync rewards in threads (task.reward_threads = true): deadlines, stuck threads, saturation.

Owns: ``RewardThreads``, the thread pool ``workers.rewards.runner`` runs sync rewards in
when asked for threads, and ``PoolSaturated``. A thread cannot be killed: a call past
its deadline is given up (a timeout) but its thread runs on, busy, and is counted
``stuck`` until the call returns, if ever. Once every thread is stuck the pool is
saturated: a call is refused at once (``PoolSaturated``, a timeout too) instead of
queueing behind threads that may never come back and timing out in its turn, and one
WARNING names task.reward_workers and task.reward_threads; a stuck call that returns
frees its thread, and calls run again. Processes, the default, have none of this: pebble
kills a process past its deadline and starts another (``workers.rewards.runner``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pebble

from workers.rewards.guard import CallFailed

log = logging.getLogger("async_rl.rewards")


class PoolSaturated(CallFailed, frozen=True):
    """A call refused because every reward thread is stuck in an earlier one."""


class RewardThreads:
    """``workers`` threads running calls bounded by ``timeout_s``; see the module
    docstring."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        self._workers, self._timeout_s = workers, timeout_s
        self._pool = pebble.ThreadPool(max_workers=workers)
        self._stuck: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()  # the pool's threads free their stuck calls
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                               asyncio.Semaphore] = weakref.WeakKeyDictionary()
        self._warned = False

    @property
    def stuck(self) -> int:
        """Threads still running a call given up at its deadline."""
        with self._lock:
            return len(self._stuck)

    @property
    def saturated(self) -> bool:
        """Every thread is stuck: no call can run until one of theirs returns."""
        return self.stuck >= self._workers

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a thread; a ``CallFailed`` past the deadline (its thread runs
        on), a ``PoolSaturated`` at once when every thread is stuck."""
        if self.saturated:
            return self._refused()
        async with self._loop_slots():  # the deadline starts when a thread is free
            if self.saturated:  # the threads got stuck while this call waited
                return self._refused()
            future = self._pool.schedule(fn, args=args)
            try:
                return await asyncio.wait_for(asyncio.wrap_future(future), self._timeout_s)
            except TimeoutError:
                with self._lock:
                    self._stuck.add(future)
                future.add_done_callback(self._returned)  # at once if it just finished
                return CallFailed(f"ran past {self._timeout_s} s", timed_out=True)

    def _returned(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._stuck.discard(future)

    def _refused(self) -> PoolSaturated:
        if not self._warned:
            self._warned = True
            log.warning(
                "all %d reward threads (task.reward_workers) are stuck in calls past "
                "task.reward_timeout_s = %g s, and threads cannot be stopped: reward calls "
                "now fail at once (counted as reward_pool_saturated) until one of those "
                "returns; with task.reward_threads = false (the default) rewards run in "
                "processes, which are killed and replaced at the deadline",
                self._workers, self._timeout_s)
        return PoolSaturated(f"every reward thread ({self._workers}) is stuck past the "
                             "timeout", timed_out=True)

    def _loop_slots(self) -> asyncio.Semaphore:
        """One call per thread at a time, per event loop that calls."""
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(self._workers)
        return self._slots[loop]

    def close(self) -> None:
        """Stops the pool without joining it (a stuck thread would block a join)."""
        self._pool.stop()
