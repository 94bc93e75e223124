"""The trainer's end of vLLM's own weight transports ("nccl", "ipc"): vLLM's trainer
engines, built by its ``WeightTransferTrainerFactory``.

Owns: ``VllmSource`` (the sender's snapshot as vLLM's trainer engines read it: a
``WeightSource`` with its metadata), ``trainer_init_info`` (each transport's init info
from the run's ``weights`` section) and ``trainer_init`` (the factory's rendezvous).

Imported only when ``weights.transport`` names one of them (``workers.weights.sender``):
importing vLLM lengthens a trainer's start, which the "gloo" transport's own end
(``workers.weights.gloo_trainer_end``) does without.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

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

from workers.weights.config import WeightsConfig
from workers.weights.group_client import GroupClient


class VllmSource(WeightSource):
    """``source``'s ``(name, tensor)`` pairs, read afresh at every send, with the
    metadata vLLM's trainer engines ask for first."""

    def __init__(self, source: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._source = source

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._source]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._source)


def trainer_init_info(weights: WeightsConfig, address: str, engines: int) -> TrainerInitInfo:
    """Rank 0's init info for ``engines`` engine workers (the group is this process and
    every one of them)."""
    bucket_bytes = weights.bucket_mb << 20
    if weights.transport == "nccl":
        return NCCLTrainerInitInfo(master_address=address, master_port=get_open_port(),
                                   world_size=engines + 1,
                                   packed_buffer_size_bytes=bucket_bytes, rank=0)
    return IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=bucket_bytes, rank=0)


def trainer_init(info: TrainerInitInfo, client: GroupClient,
                 source: Iterable[tuple[str, torch.Tensor]]
                 ) -> TrainerWeightTransferEngine[Any]:
    """The transport's rendezvous with every member of ``client``; no deadline of its own
    (the sender gives it one)."""
    return WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                     source=VllmSource(source))
