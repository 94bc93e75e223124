"""The replay queue's parked puts and takes.

Owns: ``Waiter`` (one parked put or take: what it needs and the event that wakes it) and
``WaitLine`` (one kind's waiters, first in first out, with how many waited and for how
long, as ``WaitStatistics``). Knows nothing about when a waiter may go on
(``buffers.queue.queue_core``).
"""

from __future__ import annotations

from collections import deque

import anyio

from buffers.queue.queue_records import WaitStatistics


class Waiter:
    """One parked put or take; FIFO among its kind, woken by replacing nothing but the event."""

    __slots__ = ("at_version", "event", "need")

    def __init__(self, need: int, at_version: int = 0) -> None:
        self.event = anyio.Event()
        self.need = need
        """Tokens of the item to put, or groups wanted by the take."""
        self.at_version = at_version  # the take's; unused for a put


class WaitLine(deque[Waiter]):
    """The waiters of one kind, oldest first, and what their waits added up to."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0
        """Calls that had to wait."""
        self.wait_s = 0.0
        """Their waits, summed."""

    def statistics(self) -> WaitStatistics:
        return WaitStatistics(count=self.waits, seconds=self.wait_s, waiting_now=len(self))
