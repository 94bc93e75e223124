"""Helpers shared by the async unit tests of buffers/ (imported, not collected)."""

from __future__ import annotations

from collections.abc import Callable

import anyio


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Yields to the loop until ``predicate()`` holds (a parked task has parked)."""
    for _ in range(1000):
        if predicate():
            return
        await anyio.sleep(0)
    raise AssertionError("condition never held")
