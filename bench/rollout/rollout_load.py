"""A rollout worker under a run's load: what the rollout benchmarks time.

Owns: ``checked_overrides``, which checks a benchmark's config as ``async-rl train``
does (exiting with its one line, for example how to build a missing model) and pins
``model.path`` to the resolved directory for the processes that load the config again,
and ``generate_groups``, which generates a task's first ``groups`` prompts on one
``RolloutWorker`` with ``max_inflight`` of them in flight, as a run's admission allows,
and returns the seconds it took and the completion tokens made. Knows nothing about
what the benchmarks compare.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import msgspec

from async_rl.config_io import load_config
from async_rl.run.inputs import check_inputs
from buffers.common.config import ConfigError


def checked_overrides(config_path: str, overrides: list[str]) -> list[str]:
    """``overrides`` and model.path set to the local directory it resolves to; exits with
    status 2 and one line when the config's inputs do not check."""
    try:
        config = check_inputs(load_config(config_path, overrides))
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        sys.exit(2)
    return [*overrides, f"model.path={msgspec.json.encode(config.model.path).decode()}"]


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
