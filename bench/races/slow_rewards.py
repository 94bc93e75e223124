"""The rewards ``bench/races/slow_reward.py`` scores with: the arithmetic task's check, at a cost.

Each is per-sample style and scores 1 when the completion starts with the answer, so
every variant trains on the same signal; only what a call costs differs.
"""

from __future__ import annotations

import asyncio
import time


def _correct(completion: str, answer: str) -> float:
    return 1.0 if completion.strip().startswith(answer) else 0.0


async def instant(prompt: str, completion: str, answer: str) -> float:
    """The zero-cost baseline, through the same machinery."""
    return _correct(completion, answer)


async def sleeps_20ms(prompt: str, completion: str, answer: str) -> float:
    """I/O-bound: a 20 ms wait (a sandbox, a verifier service)."""
    await asyncio.sleep(0.020)
    return _correct(completion, answer)


async def sleeps_100ms(prompt: str, completion: str, answer: str) -> float:
    """I/O-bound: a 100 ms wait (a judge model behind an API)."""
    await asyncio.sleep(0.100)
    return _correct(completion, answer)


def computes_2ms(prompt: str, completion: str, answer: str) -> float:
    """CPU-bound pure Python, about 2 ms a call: runs in the reward processes."""
    deadline = time.process_time() + 0.002
    spins = 0
    while time.process_time() < deadline:
        spins += 1
    return _correct(completion, answer)
