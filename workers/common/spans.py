"""Spans: what each worker was doing, when, and (when idle) why.

Owns: the ``Span`` record, the vocabulary of busy and idle causes per role, and
``SpanRecorder``, a cheap state machine a worker switches on state changes (never per
token): a worker is always in exactly one cause, so its spans tile its wall time with no
gaps or overlaps. Also the agent sessions' records, which travel beside the spans into
the trace: ``TurnSpan`` (one turn through the gateway), ``SessionSpan`` (one session:
its turns, the agent's stretches between them, how it ended) and ``SessionRecorder``
(the sessions one rollout engine keeps for the trace, at most ``SESSIONS_KEPT``, evenly
spaced over the run). Knows nothing about Ray, engines or files.

A worker often cannot see why it is idle (a rollout engine with no requests does not know
the gate is closed). It records ``idle``; ``async_rl.analysis.idle`` later resolves each idle
stretch against the controller's own spans (what the controller was waiting on then).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

ROLLOUT_BUSY = ("generate", "evaluate")
"""``evaluate``: the engine runs only held-out evaluation requests (generation wins when
both run)."""
WEIGHT_UPDATE = ("weight_sync", "weight_wire", "weight_load")
"""A rollout engine paused for a weight update: ``weight_wire`` while its bytes arrive,
``weight_load`` while they go into the model, ``weight_sync`` the rest of the pause
(waiting on the other members of the broadcast, the trainer's calls). A version's
snapshot is the trainer's ``weight_publish``."""
ROLLOUT_IDLE = (*WEIGHT_UPDATE, "gate_closed", "queue_full", "no_work")
TRAINER_BUSY = ("forward", "backward", "optimizer")
TRAINER_IDLE = ("wait_data", "barrier", "weight_publish", "checkpoint", "critic",
                "wait_reference", "wait_critic", "no_work")
"""``checkpoint``: the shard snapshots its state for a checkpoint, or the run waits for
an earlier checkpoint's background write to complete. ``critic``: the shard's device
computes the critic co-located with it (critic.placement = "trainer").
``wait_reference`` / ``wait_critic``: the shard holds its step and waits for the
reference's logprobs / the critic's advantages from their own workers (placement
"own")."""
CRITIC_BUSY = TRAINER_BUSY
CRITIC_IDLE = ("policy", "wait_data", "barrier", "weight_publish", "checkpoint", "no_work")
"""``policy``: the device the critic shares computes the policy (its shard's forward,
backward and optimizer, the reference's forward); the rest as for a trainer shard."""
REFERENCE_BUSY = ("forward",)
REFERENCE_IDLE = ("wait_data", "weight_publish", "checkpoint", "no_work")
"""A reference on its own workers (reference.placement = "own"): its one forward per
step is its work; the rest it waits, resolved from the controller as a trainer shard's
waits are (during the policy's update it has no work)."""
UNRESOLVED = "idle"
"""Recorded by a worker that cannot tell why it waits; resolved from controller spans."""

COMPUTING_IDLE = (*WEIGHT_UPDATE, "weight_publish", "checkpoint", "critic", "policy")
"""Idle causes during which the worker's own cores still compute: a rollout engine loads
weights, a trainer shard copies its snapshot (of weights, or of a checkpoint's state,
which its writer thread then serialises), a co-located role computes. Not busy (no
samples or gradients come of it), but the OS CPU-time cross-check counts it as work."""

BUSY = {"rollout": ROLLOUT_BUSY, "trainer": TRAINER_BUSY, "critic": CRITIC_BUSY,
        "reference": REFERENCE_BUSY}
IDLE = {"rollout": ROLLOUT_IDLE, "trainer": TRAINER_IDLE, "critic": CRITIC_IDLE,
        "reference": REFERENCE_IDLE}


class Span(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One stretch of one worker's time in one cause (times in seconds since the epoch)."""

    worker: str
    """Worker name, e.g. "rollout-0", "trainer-1", or "controller"."""
    role: str
    """rollout | trainer | critic | reference | controller"""
    rank: int
    device: str
    """e.g. "cpu:0" or "cuda:3"."""
    cause: str
    start: float
    end: float
    version: int
    """Policy version current on this worker when the span began."""


class SpanRecorder:
    """Records a worker's state changes as contiguous spans.

    ``switch(cause)`` closes the running span and opens the next (zero-length spans are
    not kept). ``drain()`` hands over the closed spans (the open one stays open).
    """

    def __init__(
        self,
        *,
        worker: str,
        role: str,
        rank: int,
        device: str,
        cause: str = UNRESOLVED,
        clock: Callable[[], float] = time.time,
        enabled: bool = True,
    ) -> None:
        self.worker, self.role, self.rank, self.device = worker, role, rank, device
        self.clock = clock
        self.enabled = enabled
        self.cause = cause
        self.version = 0
        self.since = clock()
        self._closed: list[Span] = []

    def switch(self, cause: str, version: int | None = None) -> None:
        """From now on the worker is in ``cause``; no-op when it already is."""
        if not self.enabled:
            return
        if version is None:
            version = self.version
        if cause == self.cause and version == self.version:
            return
        now = self.clock()
        if now > self.since:
            self._closed.append(
                Span(worker=self.worker, role=self.role, rank=self.rank, device=self.device,
                     cause=self.cause, start=self.since, end=now, version=self.version)
            )
        self.cause, self.version, self.since = cause, version, now

    def drain(self) -> list[Span]:
        """The closed spans since the last drain, oldest first."""
        spans, self._closed = self._closed, []
        return spans

    def flush(self) -> list[Span]:
        """Closes the running span at now (keeping its cause) and drains everything."""
        if self.enabled:
            now = self.clock()
            if now > self.since:
                self._closed.append(
                    Span(worker=self.worker, role=self.role, rank=self.rank,
                         device=self.device, cause=self.cause, start=self.since, end=now,
                         version=self.version)
                )
            self.since = now
        return self.drain()


SESSIONS_KEPT = 512
"""Agent sessions a rollout engine keeps for the trace at most: past that, every second
one of those kept is let go and only every second one from then on is kept (and so on),
so a long run's are evenly spaced over it."""


class TurnSpan(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of an agent session: a request the gateway generated (times in seconds
    since the epoch, as spans')."""

    turn: int
    """Its place in the session, from 0."""
    segment: int
    """The session's segment it went to, from 0 (a new one when the agent rewrote its
    history: ``workers.rollout.sessions``)."""
    arrived: float
    """When the gateway got the request."""
    finished: float
    """When its generation was done and recorded."""
    prompt_tokens: int
    new_prompt_tokens: int
    """The prompt's tokens past the segment's context (what the agent added since its
    last turn); the whole prompt on a segment's first turn."""
    completion_tokens: int
    min_version: int
    """The oldest policy version of its generated tokens (``NO_VERSION`` when it
    generated none)."""
    max_version: int
    """The newest (a weight update landed during the turn when it is above the
    oldest)."""
    finish_reason: str
    """stop | length"""


class SessionSpan(msgspec.Struct, frozen=True, kw_only=True):
    """One agent session (trajectory) from its opening to its closing."""

    worker: str
    """Its rollout engine, e.g. "rollout-0"."""
    session: int
    """Its number on that engine, in the order opened, from 0."""
    prompt_id: str
    member: int
    """Its trajectory's place in the group."""
    greedy: bool
    """An evaluation's trajectory."""
    opened: float
    closed: float
    outcome: str
    """done | timeout | error (``workers.rollout.agents``)."""
    refused: int
    """Its requests the gateway refused (they are no turns)."""
    turns: tuple[TurnSpan, ...]

    def stretches(self) -> list[tuple[float, float, TurnSpan | None]]:
        """Its time from opening to closing, in order, as its turns and the agent's own
        stretches between them (None: its tool calls and thinking, the wait before its
        first request and after its last). A turn that arrived while the one before it
        still ran (the session's requests are served one at a time) starts when that
        one ended."""
        out: list[tuple[float, float, TurnSpan | None]] = []
        at = self.opened
        for turn in self.turns:
            start = max(turn.arrived, at)
            if start > at:
                out.append((at, start, None))
            out.append((start, turn.finished, turn))
            at = turn.finished
        if self.closed > at:
            out.append((at, self.closed, None))
        return out

    def shifted(self, by: float) -> SessionSpan:
        """The same session with every time moved by ``by`` seconds."""
        return msgspec.structs.replace(
            self, opened=self.opened + by, closed=self.closed + by,
            turns=tuple(msgspec.structs.replace(t, arrived=t.arrived + by,
                                                finished=t.finished + by)
                        for t in self.turns))


class SessionRecorder:
    """The agent sessions one rollout engine keeps for the trace: every session whose
    number is a multiple of the stride, the stride doubling (and the kept ones thinned
    to its multiples) whenever more than ``limit`` are kept."""

    def __init__(self, *, worker: str, enabled: bool = True,
                 limit: int = SESSIONS_KEPT) -> None:
        self.worker, self.enabled, self.limit = worker, enabled, limit
        self.stride = 1
        self._kept: list[SessionSpan] = []

    def keep(self, session: SessionSpan) -> None:
        """Keeps ``session`` if its number is one the stride keeps."""
        if not self.enabled or session.session % self.stride:
            return
        self._kept.append(session)
        while len(self._kept) > self.limit:
            self.stride *= 2
            self._kept = [s for s in self._kept if s.session % self.stride == 0]

    def drain(self) -> list[SessionSpan]:
        """The sessions kept since the last drain, in the order they closed."""
        kept, self._kept = self._kept, []
        return kept
