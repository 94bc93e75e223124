"""What a simulated engine is asked (``async_rl.sim.engine``).

Owns: ``Request`` (one call's sequences: a group's samples or an evaluation prompt, and
what became of them: versions, KV-cache wait, tokens made when its engine's devices left
before it finished), ``Load`` (a weight update or a release asked of an engine: when it
was asked, paused and done) and ``settle`` (a future's result set unless its waiter was
cancelled). Knows nothing about how an engine schedules them.
"""

from __future__ import annotations

import asyncio


class Request:
    """One call's sequences (a group's samples, or one evaluation prompt); ``done`` is
    settled ``after`` seconds past its last sequence's end (the reward's latency)."""

    __slots__ = (
        "after",
        "arrived",
        "done",
        "evaluate",
        "finish",
        "lengths",
        "made",
        "max_version",
        "min_version",
        "prompt_tokens",
        "queued",
    )

    def __init__(self, prompt_tokens: int, lengths: tuple[int, ...], evaluate: bool,
                 after: float, arrived: float) -> None:
        self.prompt_tokens, self.lengths, self.evaluate = prompt_tokens, lengths, evaluate
        self.after, self.arrived = after, arrived
        self.queued = False
        """It waited for KV-cache room."""
        self.made: tuple[int, ...] | None = None
        """Ended unfinished (its engine's devices left): each sequence's tokens by then."""
        # asyncio's own future, not an anyio.Event: the cheapest wait, on asyncio's loop.
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.finish = 0
        self.min_version = self.max_version = -1


class Load:
    """A weight update asked of an engine: when it was asked, paused and done. Its pause
    is ``wire_s`` of bytes arriving then ``load_s`` of loading them, after ``start``
    (a collective begins once every member has paused: until then the engine stands
    paused, waiting on the group; None: at once)."""

    __slots__ = ("asked", "done", "done_at", "load_s", "paused", "paused_at", "start",
                 "version", "wire_s")

    def __init__(self, version: int, wire_s: float, load_s: float, asked: float,
                 start: asyncio.Future[None] | None = None) -> None:
        self.version, self.wire_s, self.load_s, self.asked = version, wire_s, load_s, asked
        self.start = start
        loop = asyncio.get_running_loop()
        # A settled future is awaited without a trip through the loop (an anyio.Event's
        # wait yields even when set): a delivery awaits every engine's in turn.
        self.paused: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.paused_at = self.done_at = asked

    @property
    def pause_s(self) -> float:
        return self.wire_s + self.load_s

    @property
    def waited(self) -> float:
        """Seconds from the ask to the pause (a drain, or the step in progress)."""
        return self.paused_at - self.asked


def settle(done: asyncio.Future[None]) -> None:
    if not done.cancelled():  # its waiter was cancelled meanwhile
        done.set_result(None)
