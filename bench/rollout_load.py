"""A rollout worker under a run's load: what the rollout benchmarks time.

Owns: ``generate_groups``, which generates a task's first ``groups`` prompts on one
``RolloutWorker`` with ``max_inflight`` of them in flight, as a run's admission allows,
and returns the seconds it took and the completion tokens made. Knows nothing about
what the benchmarks compare.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


async def generate_groups(worker: Any, source: Any, groups: int, max_inflight: int
                          ) -> tuple[float, int]:
    """(seconds, completion tokens) of generating ``groups`` groups on ``worker``."""
    admission = asyncio.Semaphore(max_inflight)
    tokens = 0

    async def one(index: int) -> None:
        nonlocal tokens
        async with admission:
            group = await worker.generate_group(source.prompt_at(index))
            tokens += sum(group.completion_lengths)

    began = time.perf_counter()
    async with asyncio.TaskGroup() as running:
        for index in range(groups):
            running.create_task(one(index))
    return time.perf_counter() - began, tokens
