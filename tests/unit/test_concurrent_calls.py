"""buffers.concurrent_calls.each: calls side by side, results in call order, the first
error raised as itself (not in a group) with the other calls cancelled."""

from __future__ import annotations

import functools

import anyio
import pytest

from buffers.concurrent_calls import each


async def answer(value: int, delay: float) -> int:
    await anyio.sleep(delay)
    return value


def test_results_come_in_call_order_whatever_order_the_calls_end_in() -> None:
    delays = [0.03, 0.0, 0.02, 0.01]
    calls = [functools.partial(answer, i, d) for i, d in enumerate(delays)]
    assert anyio.run(each, calls) == [0, 1, 2, 3]


def test_no_calls_is_no_results() -> None:
    assert anyio.run(each, []) == []


def test_the_first_error_is_raised_as_itself_and_cancels_the_rest() -> None:
    finished: list[str] = []

    async def slow() -> int:
        await anyio.sleep(5)
        finished.append("slow")
        return 1

    async def fails() -> int:
        await anyio.sleep(0.01)
        raise LookupError("no such shard")

    async def main() -> None:
        with anyio.fail_after(2):  # the slow call is cancelled, not waited for
            await each([slow, fails])

    with pytest.raises(LookupError, match="no such shard"):
        anyio.run(main)
    assert finished == []
