"""An asyncio event loop of its own, in a thread: where user coroutines run off the
caller's loop.

Owns: ``LoopThread`` (start the loop in a daemon thread, run a coroutine there and await
it from another loop with a deadline, close it cancelling whatever still runs). The task's
``async def`` rewards (``workers.rewards.runner``) and the environments of multi-turn
rollouts (``workers.rollout.turns``) run on one each, so a slow or blocking user
coroutine never holds the engine's event loop. Knows nothing about what runs on it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class LoopThread:
    """An event loop running in its own daemon thread named ``name``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()
        self._closed = False

    async def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Runs ``coro`` on this loop and awaits it from the caller's, for ``timeout_s``
        at most: past it ``TimeoutError`` (the coroutine is cancelled), even when it
        blocks this loop. Its own exceptions propagate."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        finally:
            future.cancel()  # a no-op once it is done

    def close(self) -> None:
        """Cancels what still runs, stops the loop and joins the thread; idempotent."""
        if self._closed:
            return
        self._closed = True

        async def cancel_all() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=2)
        except Exception:
            log.debug("could not cancel the tasks of %s", self._thread.name, exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()
