"""The "gloo" backend of vLLM's weight-transfer API: what NCCL does on GPUs, over a
torch.distributed gloo group, so CPU runs and CI drive the same API.

Owns: ``GlooWeightTransferEngine`` (built by vLLM in the engine's worker process when the
engine's ``weight_transfer_config`` backend is "gloo": joins the broadcast group at its
rank, receives and forwards the buckets, stages the whole version and loads it at
``finish_weight_update``: ``workers.weights.version_load``),
``GlooTrainerWeightTransferEngine`` (the trainer's end, rank 0: opens the group, drives
the inference side through a ``VLLMWeightSyncClient`` and broadcasts the buckets), their
init and update infos, and registering both with vLLM's two factories.

Which members are local (``weights.shared_memory``): the trainer's end makes a probe
in shared memory when it opens a group; an engine that can open it says so in the
group's store before joining. Local members then read each version from one shared
segment the trainer's end writes once (``workers.weights.shared_segment``); the others
form the chain (``workers.weights.bucket_transfer``).

Staging is what makes a version all or nothing: nothing of it touches the model until
every byte is held (a local member stages views of the shared segment, which the
sender does not write again until every member of the broadcast has loaded it or been
given up; the load checks that it did not), so a broadcast that fails (a member died
or stalled) leaves every engine on its old weights, whole (``receive_weights`` then
raises ``INTERRUPTED``), and the engine may go on serving them. The registration runs when
this module is imported: ``workers.weights.vllm_extension`` imports it, and vLLM imports that
extension in the worker process before it builds the worker's weight-transfer engine.

Knows nothing about Ray, versions or pausing (the client's side) or how tensors are cut
into messages (``workers.weights.bucket_transfer``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from workers.weights.adapter import is_adapter_version
from workers.weights.bucket_plan import plan_buckets, segment_layout
from workers.weights.bucket_transfer import (
    SENDER,
    broadcast_group,
    host_store,
    join_store,
    receive_buckets,
    receive_local,
    send_buckets,
)
from workers.weights.receiver import INTERRUPTED
from workers.weights.shared_segment import SharedSegment
from workers.weights.version_load import load_version

if TYPE_CHECKING:
    import torch.distributed as dist

BACKEND = "gloo"

log = logging.getLogger(__name__)


def _local_key(rank: int) -> str:
    """The store key by which member ``rank`` says it sees the trainer's shared memory."""
    return f"local/{rank}"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
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
class GlooUpdateInfo(WeightTransferUpdateInfo):
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


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives checkpoint-format weights over the broadcast group into the worker's model."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group: dist.ProcessGroupGloo | None = None
        self._store: dist.Store | None = None
        self._info: GlooInitInfo | None = None
        self._staged: list[tuple[str, torch.Tensor]] = []
        """The version being received, whole once ``receive_weights`` returns."""
        self._segment: SharedSegment | None = None
        """The trainer's shared segment, mapped (a local member), kept across versions."""
        self._segment_write = 0
        """The segment's write that ``_staged`` views (0: staged in this process's memory)."""
        self.adapter_loader: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None
        """Set by the worker extension when the engine serves the policy as a LoRA
        adapter (``serve_adapter``): a version of adapter tensors goes to it instead of
        into the model's weights."""

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Joins a (new) group; called again whenever the trainer rebuilds it."""
        self.shutdown()
        try:
            self._store = join_store(init_info.master_address, init_info.master_port,
                                     init_info.timeout_s)
            if init_info.probe_path and SharedSegment.open(
                    init_info.probe_path, 0, init_info.probe_token) is not None:
                self._store.set(_local_key(init_info.rank_offset), "1")
            self._group = broadcast_group(self._store, init_info.rank_offset,
                                          init_info.world_size, init_info.timeout_s)
        except Exception as err:  # a member (or the trainer) did not join in time
            self.shutdown()
            raise RuntimeError(f"{INTERRUPTED}: joining the weight group: {err!r}") from err
        self._info = init_info

    def start_weight_update(self) -> None:
        self._staged, self._segment_write = [], 0

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self._group is None or self._info is None:
            raise RuntimeError("gloo weight transfer: init_transfer_engine was not called")
        group, info = self._group, self._info
        names = update_info.names
        specs = [(shape, getattr(torch, dtype))
                 for shape, dtype in zip(update_info.shapes, update_info.dtype_names,
                                         strict=True)]
        local = bool(update_info.segment_path) and group.rank() not in (update_info.chain
                                                                         or ())
        segment = self._map(update_info) if local else None
        staged: list[tuple[str, torch.Tensor]] = []
        try:
            if segment is not None:
                self._segment_write, tensors = receive_local(
                    group, segment, specs, info.bucket_bytes, info.timeout_s)
                staged = [(names[i], tensor) for i, tensor in tensors]
            else:
                for ready in receive_buckets(group, specs, info.bucket_bytes,
                                             info.timeout_s, update_info.chain):
                    staged.extend((names[i], tensor) for i, tensor in ready)
        except Exception as err:
            # The group is unusable now (a member is gone or mid-message); the trainer
            # builds a new one. The model was not touched.
            self._group = None
            raise RuntimeError(f"{INTERRUPTED}: {err!r}") from err
        self._staged = staged

    def _map(self, update_info: GlooUpdateInfo) -> SharedSegment:
        """The trainer's segment for this update, mapped once per group and kept."""
        path = update_info.segment_path
        if self._segment is None or str(self._segment.path) != path:
            self._segment = SharedSegment.open(path, update_info.segment_bytes,
                                               update_info.segment_token)
        if self._segment is None:
            # The probe said this process sees the trainer's shared memory: it no
            # longer does, and a new group would say the same. Not INTERRUPTED: the
            # worker is replaced.
            raise RuntimeError(f"gloo weight transfer: cannot map the shared segment {path}")
        return self._segment

    def finish_weight_update(self) -> None:
        """Loads the staged version into the model, whole
        (``workers.weights.version_load``)."""
        staged, self._staged = self._staged, []
        write, self._segment_write = self._segment_write, 0
        if not staged:
            raise RuntimeError("gloo weight transfer: finish_weight_update before a whole "
                               "version was received")
        if self.adapter_loader is not None and is_adapter_version(n for n, _ in staged):
            if write:  # out of the segment first, then checked: the loader gets a whole copy
                staged = [(name, tensor.clone()) for name, tensor in staged]
            self._check_intact(write)
            self.adapter_loader(staged)
            return
        load_version(self.model, self.model_config, staged)
        self._check_intact(write)

    def _check_intact(self, write: int) -> None:
        """Raises if the shared segment's ``write`` (0: staged in this process's memory)
        was written again since it was staged. Never expected (the sender writes again
        only after every member loaded or was given up); if it happens what was read is
        a mix: not INTERRUPTED, the worker is replaced."""
        if write and self._segment is not None and self._segment.seq != write:
            raise RuntimeError("gloo weight transfer: the shared segment was written "
                               "again during the load")

    def shutdown(self) -> None:
        self._group = self._store = self._info = self._segment = None
        self._staged, self._segment_write = [], 0


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's end: the address its store binds (a free port is picked), the
    group's size (this rank and every inference worker) and the wire parameters it hands
    to the workers at the handshake."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    world_size: int
    bucket_bytes: int
    timeout_s: float
    shared_memory: bool = True
    """Members on this machine read each version from shared memory (else all chain)."""


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Broadcasts a ``WeightSource`` from rank 0 to every inference worker of the group,
    as vLLM's NCCL trainer engine does: one collective per version, whatever the number
    of workers. A failure anywhere fails the broadcast on every member within the
    group's timeout; the group is then unusable and the caller builds a new one.
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource,
                 info: GlooTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
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
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> Self:
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource")
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
                         if store.check([_local_key(rank)])]
        return engine

    def send_weights(self) -> None:
        assert self.source is not None and self._group is not None  # set by trainer_init
        meta = self.source.metadata()
        update_info = GlooUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        tensors = [tensor for _, tensor in self.source]
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


WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)
