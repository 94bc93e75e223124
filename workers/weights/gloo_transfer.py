"""The engine's end of the "gloo" backend of vLLM's weight-transfer API: what NCCL does on
GPUs, over a torch.distributed gloo group, so CPU runs and CI drive the same API.

Owns: ``GlooWeightTransferEngine`` (built by vLLM in the engine's worker process when the
engine's ``weight_transfer_config`` backend is "gloo": joins the broadcast group at its
rank, receives and forwards the buckets, stages the whole version and loads it at
``finish_weight_update``: ``workers.weights.version_load``), the handshake and update
records as vLLM parses them, and registering the engine with vLLM's engine factory.
The trainer's end and the records' fields are ``workers.weights.gloo_trainer_end``.

Local members (``weights.shared_memory``): an engine that can open the trainer end's
probe in shared memory says so in the group's store before joining, and then reads each
version from the one shared segment the trainer's end writes
(``workers.weights.shared_segment``); the others form the chain
(``workers.weights.bucket_transfer``).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from workers.weights.adapter import is_adapter_version
from workers.weights.bucket_transfer import (
    broadcast_group,
    join_store,
    receive_buckets,
    receive_local,
)
from workers.weights.gloo_trainer_end import BACKEND, GlooInitInfo, GlooUpdateInfo, local_key
from workers.weights.receiver import INTERRUPTED
from workers.weights.shared_segment import SharedSegment
from workers.weights.version_load import load_version

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class GlooEngineInitInfo(GlooInitInfo, WeightTransferInitInfo):
    """``GlooInitInfo`` as vLLM's engine side parses the handshake dict."""


@dataclass
class GlooEngineUpdateInfo(GlooUpdateInfo, WeightTransferUpdateInfo):
    """``GlooUpdateInfo`` as vLLM's engine side parses each update dict."""


class GlooWeightTransferEngine(WeightTransferEngine[GlooEngineInitInfo,
                                                    GlooEngineUpdateInfo]):
    """Receives checkpoint-format weights over the broadcast group into the worker's model."""

    init_info_cls = GlooEngineInitInfo
    update_info_cls = GlooEngineUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group: dist.ProcessGroupGloo | None = None
        self._store: dist.Store | None = None
        self._info: GlooEngineInitInfo | None = None
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

    def init_transfer_engine(self, init_info: GlooEngineInitInfo) -> None:
        """Joins a (new) group; called again whenever the trainer rebuilds it."""
        self.shutdown()
        try:
            self._store = join_store(init_info.master_address, init_info.master_port,
                                     init_info.timeout_s)
            if init_info.probe_path and SharedSegment.open(
                    init_info.probe_path, 0, init_info.probe_token) is not None:
                self._store.set(local_key(init_info.rank_offset), "1")
            self._group = broadcast_group(self._store, init_info.rank_offset,
                                          init_info.world_size, init_info.timeout_s)
        except Exception as err:  # a member (or the trainer) did not join in time
            self.shutdown()
            raise RuntimeError(f"{INTERRUPTED}: joining the weight group: {err!r}") from err
        self._info = init_info

    def start_weight_update(self) -> None:
        self._staged, self._segment_write = [], 0

    def receive_weights(self, update_info: GlooEngineUpdateInfo) -> None:
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

    def _map(self, update_info: GlooEngineUpdateInfo) -> SharedSegment:
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


WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
