"""Trainer shard 0's end of weight broadcasts: versioned snapshots of the weights, sent to
each rollout engine through vLLM's weight-transfer API.

Owns: ``WeightSender`` — the published snapshots (one per version, until delivered),
one trainer-side weight-transfer engine per rollout worker (vLLM's
``WeightTransferTrainerFactory`` builds it for ``weights.transport``: "gloo" is
``workers.weights.gloo_transfer``, "nccl" and "ipc" are vLLM's), each over its own group so a dead
rollout worker breaks only its own pair — and ``EngineClient``, the
``VLLMWeightSyncClient`` those engines drive: calls on one rollout worker actor, each
with a timeout, carrying the version and the update mode.

Knows nothing about when to publish or deliver (the controller, through
``workers.weights.broadcast``) or how an engine pauses and loads (``workers.weights.receiver``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import ray
import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
from vllm.utils.network_utils import get_open_port

from buffers.records import BroadcastTiming
from workers.weights.config import UpdateMode, WeightsConfig
from workers.weights.gloo_transfer import GlooTrainerInitInfo

Snapshot = tuple[tuple[str, torch.Tensor], ...]


class PairSource(WeightSource):
    """What one pair's trainer engine sends next: the snapshot set before each send
    (vLLM's engines take their source once, at ``trainer_init``)."""

    def __init__(self) -> None:
        self.snapshot: Snapshot = ()

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.snapshot]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.snapshot)


class EngineClient:
    """``VLLMWeightSyncClient`` over one ``RolloutWorker`` actor.

    Every call waits at most ``timeout_s``: a dead actor fails at once, a stuck one after
    the timeout, never a hang. The protocol's calls carry no version (vLLM's NCCL and
    IPC engines call ``finish_weight_update()`` bare), so the version and update mode of
    the next send are set with ``prepare`` and travel with ``start_weight_update``.
    """

    def __init__(self, actor: Any, timeout_s: float) -> None:
        self._actor, self._timeout_s = actor, timeout_s
        self.version = 0
        self.mode: UpdateMode | None = None
        self.refused = False
        """The worker raised at ``start_weight_update``: it refused the update before
        pausing (a version that is not newer), or failed it itself. Any other failure
        may leave it paused or half loaded without knowing, so it is told to give up."""
        self.timing: BroadcastTiming | None = None

    def prepare(self, version: int, mode: UpdateMode | None) -> None:
        self.version, self.mode, self.refused, self.timing = version, mode, False, None

    def _call(self, method: Any, *args: Any) -> Any:
        return ray.get(method.remote(*args), timeout=self._timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call(self._actor.init_weight_transfer, init_info)

    def start_weight_update(self) -> None:
        try:
            self._call(self._actor.start_weight_update, self.version, self.mode)
        except ray.exceptions.RayTaskError:
            self.refused = True
            raise

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._call(self._actor.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        # weight_version is not used: the worker labels the version it was started with.
        self.timing = self._call(self._actor.finish_weight_update)

    def abandon(self, reason: str) -> None:
        """Tells the worker the update is given up; does not wait (it may be dead)."""
        self._actor.abandon_weight_update.remote(reason)


@dataclass
class _Pair:
    client: EngineClient
    source: PairSource
    engine: TrainerWeightTransferEngine[Any]


class WeightSender:
    """Snapshots one trainer shard's weights by version and sends them to rollout engines.

    ``snapshot`` runs in the trainer's order of calls (after the step that made the
    version); ``send`` and ``release`` run beside later training steps.
    """

    def __init__(self, weights: WeightsConfig, *, address: str, device: torch.device,
                 dtype: torch.dtype | None = None) -> None:
        """address: where this process's pair endpoints listen (gloo, nccl). device: the
        trainer's device; gloo snapshots go to the CPU (gloo sends CPU tensors), the
        others stay on the device. dtype: the engines' (rollout.dtype); snapshots are
        cast to it (None: each tensor keeps its own)."""
        self._weights, self._address, self._dtype = weights, address, dtype
        self._device = torch.device("cpu") if weights.transport == "gloo" else device
        self._snapshots: dict[int, Snapshot] = {}
        self._spare: Snapshot = ()
        """A released snapshot's tensors, copied into by the next one: fresh memory
        would fault in every page at every publish, on the trainer's critical path."""
        self._lock = threading.Lock()  # snapshot runs beside sends and releases
        self._pairs: dict[int, _Pair] = {}

    def connect(self, rank: int, actor: Any) -> None:
        """Opens the transfer with rollout worker ``rank`` (a rendezvous with its engine)."""
        client = EngineClient(actor, self._weights.timeout_s)
        source = PairSource()
        engine = WeightTransferTrainerFactory.trainer_init(self._init_info(), client=client,
                                                           source=source)
        self._pairs[rank] = _Pair(client, source, engine)

    def _init_info(self) -> TrainerInitInfo:
        cfg = self._weights
        bucket_bytes = cfg.bucket_mb << 20
        # Rank 0 is the sender; a pair has this process and one engine worker.
        if cfg.transport == "gloo":
            return GlooTrainerInitInfo(master_address=self._address, bucket_bytes=bucket_bytes,
                                       timeout_s=cfg.timeout_s, rank=0)
        if cfg.transport == "nccl":
            return NCCLTrainerInitInfo(master_address=self._address,
                                       master_port=get_open_port(), world_size=2,
                                       packed_buffer_size_bytes=bucket_bytes, rank=0)
        return IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=bucket_bytes, rank=0)

    def snapshot(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copies ``named`` tensors as ``version``'s weights; returns their bytes."""
        sources = [(name, tensor.detach()) for name, tensor in named]
        wanted = [(n, t.shape, self._dtype or t.dtype) for n, t in sources]
        with self._lock:
            spare, self._spare = self._spare, ()
        if [(n, t.shape, t.dtype) for n, t in spare] != wanted:
            spare = tuple((name, torch.empty(shape, dtype=dtype, device=self._device))
                          for name, shape, dtype in wanted)
        for (_, held), (_, tensor) in zip(spare, sources, strict=True):
            held.copy_(tensor)  # casts to the engines' dtype
        if self._device.type == "cuda":
            # The copies run on this stream, after the optimizer step's kernels; the
            # transfer engines read the snapshot from streams of their own.
            torch.cuda.current_stream(self._device).synchronize()
        with self._lock:
            self._snapshots[version] = spare
        return sum(t.numel() * t.element_size() for _, t in spare)

    def send(self, version: int, rank: int, mode: UpdateMode | None = None) -> BroadcastTiming:
        """Makes ``version`` rollout worker ``rank``'s policy; its timing (publish_s 0).

        Raises when the update fails. Unless the worker refused it (it is then as it
        was, and so is the pair), the worker is told to give up and fail, and the pair is
        not used again: its group may be mid-message.
        """
        pair = self._pairs.get(rank)
        if pair is None:
            raise RuntimeError(f"no weight transfer with rollout worker {rank} (never "
                               "connected, or lost to an earlier failure)")
        with self._lock:
            pair.source.snapshot = self._snapshots[version]
        pair.client.prepare(version, mode)
        try:
            self._send_within_deadline(pair, rank)
        except BaseException as err:
            if not pair.client.refused:
                pair.client.abandon(repr(err))
                if isinstance(err, TimeoutError):
                    # Its engine is stuck mid-collective: shutting it down could block too.
                    self._pairs.pop(rank, None)
                else:
                    self.disconnect(rank)
            raise
        finally:
            pair.source.snapshot = ()
        assert pair.client.timing is not None  # set by finish_weight_update
        return pair.client.timing

    def _send_within_deadline(self, pair: _Pair, rank: int) -> None:
        """``send_weights``, given up after ``weights.timeout_s`` on the NCCL and IPC
        transports: their collectives have no deadline of their own, so a dead or stuck
        engine would hold this sender forever (gloo's group times out each operation)."""
        if self._weights.transport == "gloo":
            pair.engine.send_weights()
            return
        outcome: Future[None] = Future()

        def send() -> None:
            try:
                pair.engine.send_weights()
                outcome.set_result(None)
            except BaseException as err:
                outcome.set_exception(err)

        threading.Thread(target=send, name=f"weight-send-{rank}", daemon=True).start()
        try:
            outcome.result(timeout=self._weights.timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"weight send to rollout worker {rank} over {self._weights.transport} took "
                f"longer than weights.timeout_s ({self._weights.timeout_s:g}s)") from None

    def release(self, version: int) -> None:
        """Frees ``version``'s snapshot once every send of it is done."""
        with self._lock:
            self._spare = self._snapshots.pop(version, self._spare)

    def disconnect(self, rank: int) -> None:
        pair = self._pairs.pop(rank, None)
        if pair is not None:
            pair.engine.shutdown()

    def shutdown(self) -> None:
        for rank in list(self._pairs):
            self.disconnect(rank)
        with self._lock:
            self._snapshots.clear()
            self._spare = ()

