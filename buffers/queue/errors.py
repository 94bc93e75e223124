"""Named exceptions of the data plane, in the style of anyio's ``WouldBlock``/``EndOfStream``.

Owns: the exception types raised by the replay queue and the admission gate, so a caller
can catch one family without importing either module. Knows nothing about queues, gates
or what the controller does about them.
"""

from __future__ import annotations


class WouldBlock(Exception):
    """A ``*_nowait`` call would have had to wait (mirrors ``anyio.WouldBlock``)."""


class QueueFull(WouldBlock):
    """``put_nowait``: the replay queue has no room (by groups or by tokens) right now."""


class NotEnoughGroups(WouldBlock):
    """``take_nowait``: fewer groups are ready than were asked for."""


class QueueClosed(Exception):
    """The replay queue was closed: no more puts, and waiting takers are released."""


class QueueTooSmall(Exception):
    """A take can never be served: the queue is full by tokens before it holds enough groups.

    Raised instead of hanging; the fix is a larger ``max_tokens`` (or a smaller take).
    """


class GateShutDown(Exception):
    """The admission gate was shut down: waiting and future ``acquire`` calls raise this.

    Not to be confused with the gate being *closed* by the staleness bound, which is the
    normal state a rollout worker waits out.
    """


class SequenceTooLong(ValueError):
    """A single sequence has more tokens than the micro-batch cap, so no packing exists."""
