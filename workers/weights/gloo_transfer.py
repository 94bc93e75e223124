"""The "gloo" backend of vLLM's weight-transfer API: what NCCL and CUDA IPC do on GPUs,
over a torch.distributed gloo pair group, so CPU runs and CI drive the same API.

Owns: ``GlooWeightTransferEngine`` (built by vLLM in the engine's worker process when the
engine's ``weight_transfer_config`` backend is "gloo": joins the pair group, receives the
buckets and loads them with the same layerwise reload NCCL and IPC use),
``GlooTrainerWeightTransferEngine`` (the trainer's end: opens the pair group, drives the
inference side through a ``VLLMWeightSyncClient`` and sends the buckets), their init and
update infos, and registering both with vLLM's two factories. The registration runs when
this module is imported: ``workers.weights.vllm_extension`` imports it, and vLLM imports that
extension in the worker process before it builds the worker's weight-transfer engine.

Knows nothing about Ray, versions or pausing (the client's side) or how tensors are cut
into messages (``workers.weights.bucket_transfer``).
"""

from __future__ import annotations

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

from workers.weights.bucket_transfer import (
    RECEIVER,
    SENDER,
    host_store,
    join_store,
    pair_group,
    receive_buckets,
    send_buckets,
)

if TYPE_CHECKING:
    import torch.distributed as dist

BACKEND = "gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """The worker's end of the handshake: where the trainer's pair store listens, and
    the wire parameters both ends must agree on."""

    master_address: str
    master_port: int
    bucket_bytes: int
    timeout_s: float


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: every tensor's name, dtype and shape, in the order they are sent."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives checkpoint-format weights over the pair group into the worker's model."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group: dist.ProcessGroupGloo | None = None
        self._store: dist.Store | None = None
        self._info: GlooInitInfo | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self._store = join_store(init_info.master_address, init_info.master_port,
                                 init_info.timeout_s)
        self._group = pair_group(self._store, RECEIVER, init_info.timeout_s)
        self._info = init_info

    # vLLM's model-loading modules are imported where they are used: they are needed in
    # the worker process only, and this module is imported by the trainer too.

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self._group is None or self._info is None:
            raise RuntimeError("gloo weight transfer: init_transfer_engine was not called")
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        names = update_info.names
        specs = [(shape, getattr(torch, dtype))
                 for shape, dtype in zip(update_info.shapes, update_info.dtype_names,
                                         strict=True)]
        load_weights: Any = self.model.load_weights  # every vLLM model defines it
        with disable_mtp_completeness_check():
            # Each bucket is loaded while the next one is on the wire.
            for ready in receive_buckets(self._group, specs, self._info.bucket_bytes,
                                         self._info.timeout_s):
                if ready:
                    load_weights([(names[i], tensor) for i, tensor in ready])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._refresh_tied_head()

    def _refresh_tied_head(self) -> None:
        # With tied embeddings the checkpoint has no lm_head tensor, so the reload skips
        # the head and keeps its old kernel state. On the CPU build that state is a packed
        # copy of the old embedding (oneDNN / sgl GEMM), and logits would stay stale.
        # Re-running the head's post-load processing packs the new embedding; elsewhere
        # it is a no-op.
        head = getattr(self.model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        config = getattr(self.model, "config", None)
        if getattr(config, "tie_word_embeddings", False) and method is not None:
            method.process_weights_after_loading(head)

    def shutdown(self) -> None:
        self._group = self._store = self._info = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's end: the address its pair store binds (a free port is picked) and
    the wire parameters it hands to the worker at the handshake."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    bucket_bytes: int
    timeout_s: float


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Sends a ``WeightSource`` to one inference worker over their pair group.

    One sender, one receiver: a group per rollout engine, so a dead engine fails its own
    sends (an error from gloo, or its timeout) and no other pair's.
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource,
                 info: GlooTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self._info = info
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroupGloo | None = None
        # Runs the worker's update_weights rpc while this thread sends. Kept across
        # sends: starting a thread per send delays the rpc, and the engine is paused.
        # After a failure this pair is not used again, so a call stuck in it until its
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
        engine._store = host_store(init_info.master_address, init_info.timeout_s)
        worker_info = GlooInitInfo(
            master_address=init_info.master_address, master_port=engine._store.port,
            bucket_bytes=init_info.bucket_bytes, timeout_s=init_info.timeout_s)
        # The worker blocks in init_weight_transfer_engine until both ends have joined the
        # group, so its rpc runs on a side thread while this end joins.
        with ThreadPoolExecutor(max_workers=1) as side:
            joined = side.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine._group = pair_group(engine._store, SENDER, init_info.timeout_s)
            joined.result()
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
        self.client.start_weight_update()
        # The worker receives inside update_weights: the rpc and the sends run together.
        received = self._side.submit(self.client.update_weights, asdict(update_info))
        send_buckets(self._group, tensors, self._info.bucket_bytes, self._info.timeout_s)
        received.result()
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self._group = self._store = None
        self._side.shutdown(wait=False)


WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)
