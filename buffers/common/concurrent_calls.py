"""Calls run side by side with their results in order: anyio's task groups return
nothing, and the orchestrator needs every trainer shard's result of a step, by rank.

Owns: ``each``, the one way the project runs calls side by side where it owns the event
loop (the orchestrator, the Ray shell's actor calls, a weight version's snapshot): one
library, anyio, and one cancellation model (the first error cancels the rest). Here,
in the data plane every layer imports, so that the compute plane uses it too. Knows
nothing about what the calls do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

T = TypeVar("T")


async def each(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Runs the calls concurrently; their results in order (the first error cancels)."""
    results: list[T | None] = [None] * len(calls)

    async def one(i: int) -> None:
        results[i] = await calls[i]()

    try:
        async with anyio.create_task_group() as group:
            for i in range(len(calls)):
                group.start_soon(one, i)
    except BaseExceptionGroup as errors:
        # The first error cancels the rest, so the group holds that one error: callers
        # catch it by its own type (a timeout, a dead worker), not a group of one.
        if len(errors.exceptions) == 1:
            raise errors.exceptions[0] from None
        raise
    return results  # type: ignore[return-value]  # every slot was filled
