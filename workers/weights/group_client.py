"""The inference side of one weight broadcast, as the trainer's weight-transfer engine
drives it: every rollout worker of the group, called together.

Owns: ``GroupClient``, the ``VLLMWeightSyncClient`` over a group of ``RolloutWorker``
actors (each call goes to every member at once and waits for all of them, never past its
deadline), what each member is sent at the handshake (``member_init_infos``: its rank
in the group where the transport has one; a malformed handshake is a ``GroupFailed``),
and what each member's answer means for this version: loaded (its timing),
interrupted (the broadcast broke elsewhere; its weights are whole and old: it takes the
version again over a rebuilt group), stale (it already runs this version or a newer
one: a worker restarted from a newer policy), or lost (dead, stuck, or failed with its
weights no longer trusted: it is told to give up and the controller replaces it).

Knows nothing about tensors, buckets or process groups (the transfer engine's) or about
when to rebuild the group (``workers.weights.sender``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from buffers.common.reports import BroadcastTiming
from workers.weights.config import UpdateMode
from workers.weights.receiver import StaleVersion, UpdateInterrupted

log = logging.getLogger(__name__)

GRACE_S = 5.0
"""How much longer than a member's own deadline the trainer waits for its answer: a
member that fails by its own timeout answers just after it, and must not be taken for
a stuck one."""
POLL_S = 0.25
"""How often a wait whose deadline may move (the transfer's) looks at it again."""
CONNECT_TRIES = 4
"""Times gloo tries to connect to each peer while a group forms, each within the
group's timeout: how long a member may take to say the group did not form."""


class GroupFailed(RuntimeError):
    """A step of the update could not go on for every member (``GroupClient`` says which
    members were lost, interrupted or stale)."""


def member_init_infos(init_info: object, members: int) -> list[dict[str, Any]]:
    """What each of ``members`` engines is sent at the handshake, in member order, from
    the one init info the trainer's engine hands the client.

    A handshake with a rendezvous (gloo's, vLLM's NCCL engine's) names the first
    member's rank in the transfer group (``rank_offset``, after the sender's) and the
    group's size: member ``i`` joins as rank ``rank_offset + i`` (one vLLM worker per
    engine), and the group holds exactly the sender's ranks and every member. A handshake
    without one reaches every member unchanged: vLLM's IPC engine sends only
    ``{"packed": ...}``, and its worker side (``IPCWeightTransferInitInfo``) takes no
    other field. Anything else is a ``GroupFailed``: nobody can join a group described
    wrongly, and the sender must not fall over it.
    """
    if not isinstance(init_info, dict) or not all(isinstance(k, str) for k in init_info):
        raise GroupFailed(f"malformed weight-transfer handshake: {init_info!r}")
    if "rank_offset" not in init_info:
        return [dict(init_info) for _ in range(members)]
    offset, world_size = init_info["rank_offset"], init_info.get("world_size")
    if (not isinstance(offset, int) or isinstance(offset, bool) or offset < 1
            or world_size != offset + members):
        raise GroupFailed(f"malformed weight-transfer handshake for {members} engine(s): "
                          f"rank_offset {offset!r}, world_size {world_size!r}")
    return [{**init_info, "rank_offset": offset + i} for i in range(members)]


class GroupClient:
    """Calls every member of one broadcast group, in rank order: member ``i`` is rank
    ``rank_offset + i`` of the transfer group (the sender is rank 0).

    The protocol's calls carry no version (vLLM's NCCL engine calls
    ``finish_weight_update()`` bare), so the version and update mode of the next send
    are set with ``prepare`` and travel with ``start_weight_update``.
    """

    def __init__(self, members: Sequence[tuple[int, Any]], timeout_s: float, *,
                 sender_bounds_transfer: bool) -> None:
        """members: (rollout rank, actor) in chain order. sender_bounds_transfer: the
        transfer engine calls ``transfer_sent`` when its own sends are over (the gloo
        engine: every one of its operations has a deadline, so a member's answer is due
        ``timeout_s`` after that); otherwise the whole transfer must end within
        ``timeout_s`` (vLLM's NCCL engine, whose send has no deadline of its own)."""
        self.members = list(members)
        self._timeout_s = timeout_s
        self._sender_bounds = sender_bounds_transfer
        self._transfer_deadline = float("inf")
        self.version = 0
        self.mode: UpdateMode | None = None
        self.timings: dict[int, BroadcastTiming] = {}
        self.lost: dict[int, str] = {}
        """Members whose weights cannot be trusted or who do not answer: why."""
        self.interrupted: set[int] = set()
        self.stale: set[int] = set()
        self.received: list[int] = []
        """Members that hold every byte of the version (not yet loaded)."""
        self.wire = (0.0, 0.0)
        """From the first byte sent until the last member held every byte, on the
        machine's ``time.time()``: as the transfer engine measured it (gloo), else the
        update call's span."""
        self._sent = threading.Event()
        self._measured: tuple[float, float] | None = None
        self._join_lock = threading.Lock()
        self._join_deadline = math.inf
        """Moved to the past by ``stop_joining``: the handshake's wait ends there."""
        self._join_started = False
        self._join_over = threading.Event()

    @property
    def ranks(self) -> list[int]:
        return [rank for rank, _ in self.members]

    def prepare(self, version: int, mode: UpdateMode | None) -> None:
        self.version, self.mode = version, mode
        self.timings, self.lost, self.received = {}, {}, []
        self.interrupted, self.stale = set(), set()
        self.wire = (0.0, 0.0)
        self._sent.clear()
        self._measured = None

    # ---- the VLLMWeightSyncClient calls ----------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        payloads = member_init_infos(init_info, len(self.members))
        with self._join_lock:
            if self._join_deadline < 0:  # stop_joining came first: ask nobody
                raise GroupFailed("joining the weight group: given up by the trainer")
            self._join_started = True
            self._join_deadline = (time.monotonic() + CONNECT_TRIES * self._timeout_s
                                   + GRACE_S)
        try:
            calls = {rank: actor.init_weight_transfer.remote(payload)
                     for (rank, actor), payload in zip(self.members, payloads, strict=True)}
            answers = self._wait(calls, lambda: self._join_deadline)
            for rank, answer in answers.items():
                if isinstance(answer, UpdateInterrupted):  # the group did not form
                    self.interrupted.add(rank)
                elif isinstance(answer, BaseException):
                    self.lost[rank] = repr(answer)
        finally:
            self._join_over.set()
        if not self.lost and not self.interrupted:
            return
        raise GroupFailed(f"joining the weight group: {self._describe()}")

    def stop_joining(self) -> None:
        """The trainer gave the handshake up (its end of the rendezvous missed its
        deadline): a member that has not answered by now is lost (on NCCL it is stuck
        in the rendezvous, where no later call reaches its engine), one that answered
        is interrupted (a handshake loads nothing: its weights are whole, and it takes
        the version again over a group built without the lost ones)."""
        with self._join_lock:
            self._join_deadline = -math.inf
            started = self._join_started
        # The handshake's wait looks at its deadline every POLL_S.
        if started and not self._join_over.wait(POLL_S + GRACE_S):
            log.warning("weight group %s: the handshake did not end when given up", self.ranks)
        for rank in self.ranks:
            if rank not in self.lost:
                self.interrupted.add(rank)

    def start_weight_update(self) -> None:
        calls = {rank: actor.start_weight_update.remote(self.version, self.mode)
                 for rank, actor in self.members}
        deadline = time.monotonic() + self._timeout_s + GRACE_S
        answers = self._wait(calls, lambda: deadline)
        paused = [rank for rank, a in answers.items() if not isinstance(a, BaseException)]
        for rank, answer in answers.items():
            if isinstance(answer, StaleVersion):
                self.stale.add(rank)
            elif isinstance(answer, BaseException):
                self.lost[rank] = repr(answer)
        if len(paused) == len(self.members):
            return
        # Nothing was sent yet: the paused members resume on their old weights.
        actors = dict(self.members)
        self._wait({rank: actors[rank].cancel_weight_update.remote() for rank in paused},
                   lambda: deadline + self._timeout_s)
        self.interrupted.update(paused)
        raise GroupFailed(f"pausing for weights v{self.version}: {self._describe()}")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        began = time.time()
        self._transfer_deadline = (float("inf") if self._sender_bounds
                                   else time.monotonic() + self._timeout_s + GRACE_S)
        calls = {rank: actor.update_weights.remote(update_info)
                 for rank, actor in self.members}
        answers = self._wait(calls, lambda: self._transfer_deadline)
        ended = time.time()
        if self._sender_bounds:
            self._sent.wait(GRACE_S)  # the engine's measure comes with transfer_sent
        self.wire = self._measured or (began, ended)
        for rank, answer in answers.items():
            if not isinstance(answer, BaseException):
                self.received.append(rank)
            elif isinstance(answer, UpdateInterrupted):
                self.interrupted.add(rank)
            else:
                self.lost[rank] = repr(answer)
        if len(self.received) < len(self.members):
            raise GroupFailed(f"transferring weights v{self.version}: {self._describe()}")

    def transfer_sent(self, wire: tuple[float, float] | None = None) -> None:
        """The sender's part of the transfer is over (done or failed): every member
        answers within its own deadline from now. wire: from the first byte sent until
        the last member held every byte, when the transfer engine measured it."""
        self._measured = wire
        self._transfer_deadline = time.monotonic() + self._timeout_s + GRACE_S
        self._sent.set()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        # weight_version is not used: each worker labels the version it was started with.
        self.finish_received()
        if self.lost:
            raise GroupFailed(f"loading weights v{self.version}: {self._describe()}")

    # ---- beyond the protocol -----------------------------------------------------------

    def finish_received(self) -> None:
        """Loads the version into every member that holds all of it (after a broadcast
        that broke further down the chain, too): their timings, or lost."""
        actors = dict(self.members)
        calls = {rank: actors[rank].finish_weight_update.remote() for rank in self.received
                 if rank not in self.timings and rank not in self.lost}
        deadline = time.monotonic() + self._timeout_s + GRACE_S
        for rank, answer in self._wait(calls, lambda: deadline).items():
            if isinstance(answer, BroadcastTiming):
                self.timings[rank] = answer
            else:
                self.lost[rank] = repr(answer)

    def abandon_lost(self) -> None:
        """Tells every lost member the update is given up (it fails itself; the
        controller replaces it). Does not wait: it may be dead or stuck."""
        actors = dict(self.members)
        for rank, why in self.lost.items():
            actors[rank].abandon_weight_update.remote(why)

    def _describe(self) -> str:
        parts = [f"rollout worker {rank} lost ({why})" for rank, why in self.lost.items()]
        if self.interrupted:
            parts.append(f"interrupted, weights kept: {sorted(self.interrupted)}")
        if self.stale:
            parts.append(f"already newer: {sorted(self.stale)}")
        return "; ".join(parts) or "no member answered"

    @staticmethod
    def _wait(calls: dict[int, Any], deadline: Callable[[], float]) -> dict[int, Any]:
        """Each call's result or exception; a call unanswered at ``deadline()`` (which
        may move while waiting) gets a TimeoutError."""
        waiting = dict(calls)
        answers: dict[int, Any] = {}
        while waiting:
            left = deadline() - time.monotonic()
            if left <= 0:
                break
            ready, _ = ray.wait(list(waiting.values()), num_returns=len(waiting),
                                timeout=min(left, POLL_S))
            for rank in [r for r, ref in waiting.items() if ref in ready]:
                try:
                    answers[rank] = ray.get(waiting.pop(rank))
                except Exception as err:
                    answers[rank] = err
        for rank in waiting:
            answers[rank] = TimeoutError(f"rollout worker {rank} did not answer in time")
        return answers
