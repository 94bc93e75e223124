"""The trainer's end of the "gloo" weight transport, and the records both ends share: what
vLLM's NCCL trainer engine does on GPUs, over a torch.distributed gloo group, for CPU
runs and CI.

Owns: ``GlooTrainerEnd`` (trainer shard 0's end, rank 0: opens the group, drives the
inference side through a ``workers.weights.group_client.GroupClient`` and broadcasts
each version's buckets), its ``GlooTrainerInitInfo``, and the handshake and update
records every engine's end receives (``GlooInitInfo``, ``GlooUpdateInfo``, sent as
dicts; the engine's end, ``workers.weights.gloo_transfer``, parses them as vLLM's
weight-transfer API does).

It imports no vLLM: the trainer's process is the only one that builds this end, and
importing vLLM there lengthened every trainer's start (docs/benchmarks.md, "Demo and
test timings"). vLLM's own transports ("nccl", "ipc") are
``workers.weights.vllm_trainer_end``.

Which members are local (``weights.shared_memory``): this end makes a probe in shared
memory when it opens a group; an engine that can open it says so in the group's store
before joining. Local members then read each version from one shared segment this end
writes once (``workers.weights.shared_segment``); the others form the chain
(``workers.weights.bucket_transfer``).

Knows nothing about versions or pausing (the client's side) or how tensors are cut
into messages (``workers.weights.bucket_transfer``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Self

import torch

from workers.weights.bucket_plan import plan_buckets, segment_layout
from workers.weights.bucket_transfer import SENDER, broadcast_group, host_store, send_buckets
from workers.weights.shared_segment import SharedSegment

if TYPE_CHECKING:
    import torch.distributed as dist

    from workers.weights.group_client import GroupClient

BACKEND = "gloo"

log = logging.getLogger(__name__)


def local_key(rank: int) -> str:
    """The store key by which member ``rank`` says it sees the trainer's shared memory."""
    return f"local/{rank}"


@dataclass
class GlooInitInfo:
    """The worker's end of the handshake: where the trainer's store listens, the worker's
    rank in the group (``rank_offset``, as vLLM's NCCL engine names it: each engine here
    has one worker) and its size, and the wire parameters every member must agree on."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int
    timeout_s: float
    probe_path: str = ""
    """The trainer's probe in shared memory ("": none; every member is in the chain)."""
    probe_token: str = ""


@dataclass
class GlooUpdateInfo:
    """One update: every tensor's name, dtype and shape, in the order they are sent;
    the chain (the members that receive over the group, in order) and the shared
    segment the others read."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    chain: list[int] | None = None
    segment_path: str = ""
    segment_bytes: int = 0
    segment_token: str = ""


@dataclass
class GlooTrainerInitInfo:
    """The trainer's end: the address its store binds (a free port is picked), the
    group's size (this rank and every inference worker), the wire parameters it hands
    to the workers at the handshake, and this trainer process's rank (0 sends)."""

    master_address: str
    world_size: int
    bucket_bytes: int
    timeout_s: float
    shared_memory: bool = True
    """Members on this machine read each version from shared memory (else all chain)."""
    rank: int = 0

    @property
    def is_sender(self) -> bool:
        return self.rank == SENDER


class GlooTrainerEnd:
    """Broadcasts the source's ``(name, tensor)`` pairs from rank 0 to every inference
    worker of the group, as vLLM's NCCL trainer engine does (the same three calls:
    ``trainer_init``, ``send_weights``, ``shutdown``): one collective per version,
    whatever the number of workers. A failure anywhere fails the broadcast on every
    member within the group's timeout; the group is then unusable and the caller builds
    a new one.
    """

    def __init__(self, *, client: GroupClient, source: Iterable[tuple[str, torch.Tensor]],
                 info: GlooTrainerInitInfo) -> None:
        self.client, self.source = client, source
        self._info = info
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroupGloo | None = None
        self._local: list[int] = []
        """The members that saw the probe: they read the shared segment."""
        self._segment: SharedSegment | None = None
        # Runs the worker's update_weights rpc while this thread sends. Kept across
        # sends: starting a thread per send delays the rpc, and the engine is paused.
        # After a failure this engine is not used again, so a call stuck in it until its
        # timeout holds up nothing.
        self._side = ThreadPoolExecutor(max_workers=1)

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: GroupClient,
                     source: Iterable[tuple[str, torch.Tensor]]) -> Self:
        """Opens the group (this end at rank 0) and has every member join it."""
        if not init_info.is_sender:
            raise ValueError("gloo weight transfer has one sender: trainer rank 0")
        engine = cls(client=client, source=source, info=init_info)
        store = engine._store = host_store(init_info.master_address, init_info.timeout_s)
        probe = _shared(0) if init_info.shared_memory else None
        # Workers sit at rank_offset 1, after the sender (the client numbers its workers
        # on from there, one rank each).
        worker_info = GlooInitInfo(
            master_address=init_info.master_address, master_port=store.port,
            rank_offset=SENDER + 1, world_size=init_info.world_size,
            bucket_bytes=init_info.bucket_bytes, timeout_s=init_info.timeout_s,
            probe_path=str(probe.path) if probe else "",
            probe_token=probe.token.hex() if probe else "")
        # The workers block in init_weight_transfer_engine until every rank has joined
        # the group, so their rpc runs on a side thread while this end joins.
        with ThreadPoolExecutor(max_workers=1) as side:
            joined = side.submit(client.init_weight_transfer_engine, asdict(worker_info))
            try:
                engine._group = broadcast_group(store, SENDER, init_info.world_size,
                                                init_info.timeout_s)
            finally:
                if probe is not None:
                    probe.unlink()
                joined.result()  # the workers' failure says more than this end's timeout
        # Every member set its key before it joined, so the group's forming is the
        # barrier after which the keys are all there.
        engine._local = [rank for rank in range(SENDER + 1, init_info.world_size)
                         if store.check([local_key(rank)])]
        return engine

    def send_weights(self) -> None:
        assert self._group is not None  # set by trainer_init
        named = list(self.source)
        tensors = [tensor for _, tensor in named]
        update_info = GlooUpdateInfo(
            names=[name for name, _ in named],
            dtype_names=[str(t.dtype).removeprefix("torch.") for t in tensors],
            shapes=[list(t.shape) for t in tensors],
        )
        segment = self._segment_for(tensors) if self._local else None
        local = self._local if segment is not None else []
        update_info.chain = [rank for rank in range(SENDER + 1, self._info.world_size)
                             if rank not in local]
        if segment is not None:
            update_info.segment_path = str(segment.path)
            update_info.segment_bytes = segment.nbytes
            update_info.segment_token = segment.token.hex()
        self.client.start_weight_update()
        # The workers receive inside update_weights: the rpc and the sends run together.
        received = self._side.submit(self.client.update_weights, asdict(update_info))
        wire: tuple[float, float] | None = None
        try:
            wire = send_buckets(self._group, tensors, self._info.bucket_bytes,
                                self._info.timeout_s, local=local, segment=segment)
        except Exception:
            self._group = None  # mid-message: never used again
            raise
        finally:
            if segment is not None:
                segment.unlink()  # every local member mapped it before it said ready
            # From now on every worker answers within its own deadline (a client that
            # waits on its workers needs to know when that clock starts).
            sent = getattr(self.client, "transfer_sent", None)
            if sent is not None:
                sent(wire)
            # On a failure too: the workers' failures say which member broke the chain,
            # and they replace this end's.
            received.result()
        self.client.finish_weight_update()

    def _segment_for(self, tensors: list[torch.Tensor]) -> SharedSegment | None:
        """The shared segment this version fits (kept from the last one if it is the
        same size); None when shared memory has no room for it (every member is in the
        chain then)."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        _, total = segment_layout(plan_buckets(sizes, self._info.bucket_bytes))
        if self._segment is None or self._segment.nbytes != total:
            if self._segment is not None:
                self._segment.unlink()
            self._segment = _shared(total)
        return self._segment

    def shutdown(self) -> None:
        if self._segment is not None:
            self._segment.unlink()
        self._group = self._store = self._segment = None
        self._side.shutdown(wait=False)


def _shared(nbytes: int) -> SharedSegment | None:
    """A new shared segment, or None (logged) when ``/dev/shm`` cannot hold it."""
    try:
        return SharedSegment.create(nbytes)
    except OSError as err:
        log.warning("weights: no shared memory for %d bytes (%r): every rollout engine "
                    "receives over the chain", nbytes, err)
        return None


