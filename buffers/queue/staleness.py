"""The admission gate: AReaL's staleness rule applied before a prompt starts.

Owns: the count of started groups, the current policy version, and the rule that a
prompt may start only while ``started < (version + ahead + 1) * groups_per_step``, where
``ahead`` is ``max_ahead`` (staleness.max_ahead: how far generation may run ahead of
training) capped at ``max_staleness``, or ``max_staleness`` itself when no ``max_ahead``
is set. So a prompt starts at most ``ahead`` versions before the step its place in line
falls to, and a group trained by that step is at most ``ahead`` versions old; one that
comes back later has ``max_staleness - ahead`` versions more before the queue drops it.
The bounds may change while a run trains: ``set_max_staleness``.
Knows nothing about prompts, rollout workers or the queue: callers ``acquire`` a slot
before starting a prompt and ``release`` it when the start is cancelled or failed, or when
the queue drops the group as stale and the prompt is re-queued (without that give-back
the trainer could wait forever for a step's worth of groups while the gate stays shut).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import anyio
import msgspec

from buffers.common.config import StalenessConfig
from buffers.queue.errors import GateShutDown

__all__ = ["AdmissionGate", "GateSnapshot", "GateStatistics"]


class GateStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A point-in-time view of the gate."""

    version: int
    started: int
    """Slots held: admitted minus released (plus what a restore brought)."""
    limit: int
    """``(version + ahead + 1) * groups_per_step`` (``AdmissionGate.ahead``)."""
    open_slots: int
    admitted_total: int
    released_total: int
    waits: int
    """``acquire`` calls that found the gate shut and had to wait."""
    wait_seconds: float
    """Total seconds of finished waits (the ``gate_closed`` idle cause)."""
    waiting_now: int
    shut_down: bool


class GateSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The counters a checkpoint keeps, so a resumed run admits exactly as the old one."""

    version: int
    started: int
    admitted_total: int
    released_total: int

    def holding(self, n: int) -> GateSnapshot:
        """These counters with ``n`` of the slots they gave back held again (groups a
        checkpoint keeps after all: their slots are spent once they train)."""
        if n < 0 or n > self.released_total:
            raise ValueError(f"holding({n}) with {self.released_total} slots released")
        return msgspec.structs.replace(self, started=self.started + n,
                                       released_total=self.released_total - n)


class _GateWaiter:
    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.granted = False


class AdmissionGate:
    """Counts started groups against the staleness budget of the current version.

    With ``max_staleness == 0`` (or ``max_ahead == 0``) it admits exactly
    ``groups_per_step`` prompts per version: synchronous on-policy training. Slots are
    handed to waiters in FIFO order. Like the queue, ``acquire`` does not yield to the
    event loop when a slot is open.
    """

    @classmethod
    def from_config(cls, staleness: StalenessConfig, *, groups_per_step: int,
                    clock: Callable[[], float] = time.perf_counter) -> AdmissionGate:
        """The gate of staleness.max_staleness and staleness.max_ahead (-1: none), for
        steps of ``groups_per_step`` groups (trainer.groups_per_step)."""
        return cls(groups_per_step=groups_per_step, max_staleness=staleness.max_staleness,
                   max_ahead=None if staleness.max_ahead < 0 else staleness.max_ahead,
                   clock=clock)

    def __init__(self, *, groups_per_step: int, max_staleness: int,
                 max_ahead: int | None = None, version: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``max_ahead``: how many versions generation may run ahead (None: as many as
        ``max_staleness``; more than it admits only ``max_staleness``). ``clock``: what
        waits are timed with (a simulation passes its virtual clock)."""
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step={groups_per_step}: must be >= 1")
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        if max_ahead is not None and max_ahead < 0:
            raise ValueError(f"max_ahead={max_ahead}: must be >= 0 (None: max_staleness)")
        if version < 0:
            raise ValueError(f"version={version}: must be >= 0")
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.max_ahead = max_ahead
        self._clock = clock
        self._version = version
        self._started = 0
        self._admitted = 0
        self._released = 0
        self._waiters: deque[_GateWaiter] = deque()
        self._waits = 0
        self._wait_s = 0.0
        self._shut_down = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def started(self) -> int:
        return self._started

    @property
    def ahead(self) -> int:
        """Versions generation may run ahead now: ``max_ahead`` capped at
        ``max_staleness`` (a run retuned below it admits no further than it may train),
        or ``max_staleness`` without one."""
        if self.max_ahead is None:
            return self.max_staleness
        return min(self.max_ahead, self.max_staleness)

    @property
    def limit(self) -> int:
        return (self._version + self.ahead + 1) * self.groups_per_step

    @property
    def open_slots(self) -> int:
        """How many prompts could start right now without waiting."""
        return max(0, self.limit - self._started)

    async def acquire(self) -> None:
        """Takes a slot for one prompt, waiting while the staleness bound keeps the gate shut.

        Raises ``GateShutDown`` after ``shut_down()``. A cancelled wait that had already
        been handed a slot gives it back.
        """
        if self._shut_down:
            raise GateShutDown
        if self.try_acquire():
            return
        waiter = _GateWaiter()
        self._waiters.append(waiter)
        self._waits += 1
        started = self._clock()
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release()
            elif waiter in self._waiters:  # not if shut_down() already took it out
                self._waiters.remove(waiter)
            raise
        finally:
            self._wait_s += self._clock() - started
        if not waiter.granted:
            raise GateShutDown

    def try_acquire(self) -> bool:
        """Takes a slot if one is open now (and nobody waits before us); never waits."""
        if self._shut_down:
            raise GateShutDown
        if self._waiters or self._started >= self.limit:
            return False
        self._started += 1
        self._admitted += 1
        return True

    def release(self, n: int = 1) -> None:
        """Gives ``n`` slots back: a start that was cancelled or failed, or a stale drop."""
        if n < 0 or n > self._started:
            raise ValueError(f"release({n}) with {self._started} slots held")
        self._started -= n
        self._released += n
        self._grant()

    def on_version(self, version: int) -> None:
        """The trainer published ``version``: the budget grows by ``groups_per_step``/step."""
        if version < self._version:
            raise ValueError(f"version went back from {self._version} to {version}")
        self._version = version
        self._grant()

    def set_max_staleness(self, max_staleness: int) -> None:
        """A new bound (a run retuned while it trains): raised, waiters get the slots it
        opens (up to ``max_ahead``, if set); lowered, no prompt starts until the version
        catches up with the slots held (groups already started that end too stale are
        the queue's to drop)."""
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        self.max_staleness = max_staleness
        self._grant()

    def shut_down(self) -> None:
        """Wakes every waiter with ``GateShutDown``; later acquires raise it too."""
        self._shut_down = True
        while self._waiters:
            self._waiters.popleft().event.set()

    def statistics(self) -> GateStatistics:
        return GateStatistics(
            version=self._version,
            started=self._started,
            limit=self.limit,
            open_slots=self.open_slots,
            admitted_total=self._admitted,
            released_total=self._released,
            waits=self._waits,
            wait_seconds=self._wait_s,
            waiting_now=len(self._waiters),
            shut_down=self._shut_down,
        )

    def snapshot(self, *, in_flight: int = 0) -> GateSnapshot:
        """The counters for a checkpoint.

        ``in_flight``: prompts started but not yet queued, whose work the checkpoint does
        not keep; they are saved as released, so the resumed run can start them again.
        """
        if in_flight < 0 or in_flight > self._started:
            raise ValueError(f"in_flight={in_flight} with {self._started} slots held")
        return GateSnapshot(
            version=self._version,
            started=self._started - in_flight,
            admitted_total=self._admitted,
            released_total=self._released + in_flight,
        )

    def restore(self, snapshot: GateSnapshot) -> None:
        """Loads a snapshot into this new gate (its config may differ from the old run's)."""
        if self._admitted or self._waiters:
            raise RuntimeError("restore() needs a new gate")
        self._version = snapshot.version
        self._started = snapshot.started
        self._admitted = snapshot.admitted_total
        self._released = snapshot.released_total

    def _grant(self) -> None:
        # Hand slots straight to waiters (not just wake them), so a try_acquire between
        # the wake-up and the waiter running cannot take the slot from under it.
        while self._waiters and self._started < self.limit:
            waiter = self._waiters.popleft()
            waiter.granted = True
            self._started += 1
            self._admitted += 1
            waiter.event.set()
