"""Trainer shard 0's end of weight broadcasts: versioned snapshots of the weights,
broadcast to every rollout engine at once, which receives them through vLLM's
weight-transfer API.

Owns: ``WeightSender`` — the published snapshots (one per version, until delivered), the
members (the rollout workers connected, by rank) and the one broadcast group over them:
the transport's trainer end (``weights.transport``: "gloo" is
``workers.weights.gloo_trainer_end``; "nccl" and "ipc" are vLLM's trainer engines,
``workers.weights.vllm_trainer_end``, imported only then) driving a
``workers.weights.group_client.GroupClient`` over every member. One collective per
version, whatever the number of engines. The group is built at the first send and again
whenever its members change: a member lost in a broadcast is left out and the others
take the version again over the new group in the same delivery; a member connected since
(a replacement) joins at the next version. At start it removes the shared-memory
segments that killed senders left on this machine
(``workers.weights.shared_segment.remove_orphans``).

Knows nothing about when to publish or deliver (the controller, through
``workers.weights.broadcast``) or how an engine pauses and loads (``workers.weights.receiver``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from buffers.common.reports import BroadcastTiming
from workers.weights.broadcast import Delivery
from workers.weights.config import UpdateMode, WeightsConfig
from workers.weights.gloo_trainer_end import GlooTrainerEnd, GlooTrainerInitInfo
from workers.weights.group_client import GroupClient, GroupFailed
from workers.weights.shared_segment import remove_orphans

log = logging.getLogger(__name__)

Snapshot = tuple[tuple[str, torch.Tensor], ...]
T = TypeVar("T")


MAX_ATTEMPTS = 3
"""Broadcasts of one version at most: the first, and retries over a rebuilt group for
the members it interrupted (a retry follows only an attempt that left a member out:
lost, or already on a newer version; a failure nobody can be blamed for is not
retried, since the same group would meet it again)."""


class SnapshotSource:
    """What the transport's trainer end sends next: the snapshot set before each send
    (the ends take their source once, when the group is built)."""

    def __init__(self) -> None:
        self.snapshot: Snapshot = ()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.snapshot)


class TrainerEnd(Protocol):
    """A transport's trainer end once its group is built (``GlooTrainerEnd``, or one of
    vLLM's trainer engines)."""

    def send_weights(self) -> None: ...

    def shutdown(self) -> None: ...


@dataclass
class _Group:
    client: GroupClient
    engine: TrainerEnd


def _within(call: Callable[[], T], timeout_s: float, *, name: str,
            late: Callable[[T], None] | None = None) -> T:
    """``call()``'s result, run on a thread of its own and waited for at most
    ``timeout_s``: past it, TimeoutError. The thread is left behind (a collective cannot
    be interrupted); whatever it returns after that goes to ``late``."""
    outcome: Future[T] = Future()

    def run() -> None:
        try:
            outcome.set_result(call())
        except BaseException as err:
            outcome.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        return outcome.result(timeout=timeout_s)
    except TimeoutError:
        if late is not None:
            outcome.add_done_callback(
                lambda done: None if done.exception() else late(done.result()))
        raise


class WeightSender:
    """Snapshots one trainer shard's weights by version and broadcasts them to the rollout
    engines.

    ``snapshot`` runs in the trainer's order of calls (after the step that made the
    version); ``send`` and ``release`` run beside later training steps.
    """

    def __init__(self, weights: WeightsConfig, *, address: str, device: torch.device,
                 dtype: torch.dtype | None = None) -> None:
        """address: where this process's group endpoint listens (gloo, nccl). device: the
        trainer's device; gloo snapshots go to the CPU (gloo sends CPU tensors), the
        others stay on the device. dtype: the engines' (rollout.dtype); snapshots are
        cast to it (None: each tensor keeps its own)."""
        self._weights, self._address, self._dtype = weights, address, dtype
        self._device = torch.device("cpu") if weights.transport == "gloo" else device
        self._snapshots: dict[int, Snapshot] = {}
        self._spare: Snapshot = ()
        """A released snapshot's tensors, copied into by the next one: fresh memory
        would fault in every page at every publish, on the trainer's critical path."""
        self._lock = threading.Lock()  # snapshot and connect run beside sends
        self._members: dict[int, Any] = {}
        self._group: _Group | None = None
        self._rebuild = False  # a member (re)connected since the group was built
        self._source = SnapshotSource()
        remove_orphans()  # once per run, on the one machine that makes segments

    def connect(self, rank: int, actor: Any) -> None:
        """Makes rollout worker ``rank`` (a new actor, if it replaces one) a member: the
        group is built again at the next send, with it."""
        with self._lock:
            self._members[rank] = actor
            self._rebuild = True

    def disconnect(self, rank: int) -> None:
        with self._lock:
            self._members.pop(rank, None)

    def snapshot(self, version: int, named: Iterable[tuple[str, torch.Tensor]],
                 shapes: Sequence[tuple[str, torch.Size, torch.dtype]] | None = None) -> int:
        """Copies ``named`` tensors as ``version``'s weights; returns their bytes.

        shapes: each tensor's (name, shape, dtype), in ``named``'s order. Given, ``named``
        is taken one tensor at a time, each copied before the next is asked for, so a
        lazy iterable (a gather, bucket by bucket) never has them all alive at once."""
        if shapes is None:
            sources = [(name, tensor.detach()) for name, tensor in named]
            named = sources
            shapes = [(name, tensor.shape, tensor.dtype) for name, tensor in sources]
        wanted = [(n, torch.Size(shape), self._dtype or dtype) for n, shape, dtype in shapes]
        with self._lock:
            spare, self._spare = self._spare, ()
        if [(n, t.shape, t.dtype) for n, t in spare] != wanted:
            spare = tuple((name, torch.empty(shape, dtype=dtype, device=self._device))
                          for name, shape, dtype in wanted)
        for (name, held), (source, tensor) in zip(spare, named, strict=True):
            if source != name:
                raise ValueError(f"weights v{version}: {source} arrived where {name} was due")
            held.copy_(tensor.detach())  # casts to the engines' dtype
        if self._device.type == "cuda":
            # The copies run on this stream, after the optimizer step's kernels; the
            # transfer engines read the snapshot from streams of their own.
            torch.cuda.current_stream(self._device).synchronize()
        with self._lock:
            self._snapshots[version] = spare
        return sum(t.numel() * t.element_size() for _, t in spare)

    def send(self, version: int, ranks: Sequence[int], mode: UpdateMode | None = None
             ) -> Delivery:
        """Makes ``version`` the policy of rollout workers ``ranks`` (the live ones), in
        one broadcast; retried over a rebuilt group for the members a lost one
        interrupted. Every member ends up loaded (its timing), lost (in ``failed``: told
        to give up), or, after ``MAX_ATTEMPTS``, on its old weights, whole (neither: it
        takes the next version)."""
        with self._lock:
            self._source.snapshot = self._snapshots[version]
            members = dict(self._members)
            if self._rebuild:
                self._rebuild = False
                self._drop_group()
        failed = [rank for rank in ranks if rank not in members]  # never connected
        todo = sorted(rank for rank in ranks if rank in members)
        timings: list[BroadcastTiming] = []
        wire: tuple[float, float] = (0.0, 0.0)
        attempts = 0
        try:
            while todo and attempts < MAX_ATTEMPTS:
                attempts += 1
                client = self._attempt(version, [(r, members[r]) for r in todo], mode)
                timings.extend(client.timings.values())
                failed.extend(client.lost)
                wire = client.wire if client.wire[1] else wire
                if not client.lost and not client.stale:
                    break  # done, or nothing found out: a retry would meet the same
                todo = sorted(client.interrupted)
        finally:
            self._source.snapshot = ()
        return Delivery(timings=sorted(timings, key=lambda t: t.rollout_rank),
                        failed=sorted(failed), wire_start=wire[0], wire_end=wire[1],
                        attempts=attempts)

    def _attempt(self, version: int, members: list[tuple[int, Any]],
                 mode: UpdateMode | None) -> GroupClient:
        """One broadcast to ``members`` (the group rebuilt first if they changed); the
        client's account of each member."""
        group = self._group
        if group is None or group.client.members != members:
            self._drop_group()
            client = GroupClient(members, self._weights.timeout_s,
                                 sender_bounds_transfer=self._weights.transport == "gloo")
            client.prepare(version, mode)
            try:
                engine = self._join(client)
            except GroupFailed as err:
                log.warning("weight group of %s not built: %s", client.ranks, err)
                client.abandon_lost()
                return client
            group = self._group = _Group(client, engine)
        client = group.client
        client.prepare(version, mode)
        try:
            self._send_within_deadline(group)
        except Exception as err:  # GroupFailed, or the sender's own failure
            log.warning("weights v%d: broadcast to %s failed: %s", version, client.ranks, err)
            client.finish_received()  # members holding every byte load it all the same
            for rank in client.ranks:
                if rank not in client.timings and rank not in client.interrupted | client.stale:
                    client.lost.setdefault(rank, repr(err))
            client.abandon_lost()
            self._drop_group(shut=not isinstance(err, TimeoutError))
        return client

    def _init_info(self, engines: int) -> Any:
        """The transport's init info for rank 0, the sender (the group is this process and
        every engine worker)."""
        cfg = self._weights
        if cfg.transport == "gloo":
            return GlooTrainerInitInfo(master_address=self._address, world_size=engines + 1,
                                       bucket_bytes=cfg.bucket_mb << 20,
                                       timeout_s=cfg.timeout_s,
                                       shared_memory=cfg.shared_memory, rank=0)
        from workers.weights import vllm_trainer_end  # vLLM's import, only for its transports

        return vllm_trainer_end.trainer_init_info(cfg, self._address, engines)

    def _join(self, client: GroupClient) -> TrainerEnd:
        """The group's rendezvous (the engine's ``trainer_init``), given up after
        ``weights.timeout_s`` on the NCCL and IPC transports: vLLM's NCCL rendezvous waits
        for every member with no deadline of its own, so one engine that never joins
        would hold this sender, and every later publish, forever (gloo's group times out
        by itself). A missed deadline is a ``GroupFailed``: the members that never
        joined are lost, and the others take the version over a group without them."""
        transport, timeout_s = self._weights.transport, self._weights.timeout_s
        info = self._init_info(len(client.members))
        if transport == "gloo":
            return GlooTrainerEnd.trainer_init(info, client=client, source=self._source)
        from workers.weights import vllm_trainer_end

        def join() -> TrainerEnd:
            return vllm_trainer_end.trainer_init(info, client, self._source)

        try:
            # A group formed after all (too late) is shut down: nobody will use it.
            return _within(join, timeout_s, name="weight-join",
                           late=lambda engine: engine.shutdown())
        except (TimeoutError, dist.DistError) as err:  # the deadline, or the store's own
            client.stop_joining()
            why = (f"took longer than weights.timeout_s ({timeout_s:g}s)"
                   if isinstance(err, TimeoutError) else f"failed: {err!r}")
            raise GroupFailed(f"joining the weight group of rollout workers {client.ranks} "
                              f"over {transport} {why}") from None

    def _send_within_deadline(self, group: _Group) -> None:
        """``send_weights``, given up after ``weights.timeout_s`` on the NCCL and IPC
        transports: their collectives have no deadline of their own, so a dead or stuck
        engine would hold this sender forever (gloo's group times out each operation)."""
        if self._weights.transport == "gloo":
            group.engine.send_weights()
            return
        try:
            _within(group.engine.send_weights, self._weights.timeout_s, name="weight-send")
        except TimeoutError:
            raise TimeoutError(
                f"weight send to rollout workers {group.client.ranks} over "
                f"{self._weights.transport} took longer than weights.timeout_s "
                f"({self._weights.timeout_s:g}s)") from None

    def _drop_group(self, *, shut: bool = True) -> None:
        """Forgets the group (it is rebuilt at the next send). ``shut``: shut its engine
        down too; not when it is stuck mid-collective (that could block as well)."""
        group, self._group = self._group, None
        if group is not None and shut:
            group.engine.shutdown()

    def release(self, version: int) -> None:
        """Frees ``version``'s snapshot once every send of it is done."""
        with self._lock:
            self._spare = self._snapshots.pop(version, self._spare)

    def shutdown(self) -> None:
        self._drop_group()
        with self._lock:
            self._members.clear()
            self._snapshots.clear()
            self._spare = ()
