"""``each``: results in call order, and the first error raised as itself."""

import anyio
import pytest

from buffers.common.concurrent_calls import each


class Lost(Exception):
    pass


def test_results_come_back_in_call_order_whatever_order_they_finish_in() -> None:
    async def after(delay: float, value: int) -> int:
        await anyio.sleep(delay)
        return value

    async def main() -> list[int]:
        return await each([lambda: after(0.03, 0), lambda: after(0.0, 1),
                           lambda: after(0.01, 2)])

    assert anyio.run(main) == [0, 1, 2]


def test_no_calls_give_no_results() -> None:
    async def main() -> list[int]:
        return await each([])

    assert anyio.run(main) == []


def test_the_first_error_is_raised_as_itself_and_cancels_the_rest() -> None:
    finished: list[str] = []

    async def fails() -> int:
        raise Lost("worker 1")

    async def slow() -> int:
        await anyio.sleep(5)
        finished.append("slow")
        return 0

    async def main() -> list[int]:
        return await each([slow, fails])

    with pytest.raises(Lost, match="worker 1"):
        anyio.run(main)
    assert finished == []
