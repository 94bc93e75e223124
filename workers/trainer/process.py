"""A trainer shard's process: the cores it runs on and the process group it joins.

Owns: pinning the process to its cores (so that roles on one CPU machine behave like
separate devices) and the choice of collective backend per device. Knows nothing about
the model, the optimizer or Ray.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def pin_to_cpus(cpu_ids: tuple[int, ...]) -> None:
    """Gives this process its own cores so roles behave like separate devices."""
    if cpu_ids and hasattr(os, "sched_setaffinity"):
        available = os.sched_getaffinity(0)
        wanted = {c for c in cpu_ids if c in available} or available
        os.sched_setaffinity(0, wanted)
        torch.set_num_threads(len(wanted))


def process_group_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones: each backend takes only its own, so
    every collective's tensors must live on this device (``TrainerShard.device``)."""
    return "nccl" if device.type == "cuda" else "gloo"


def join_process_group(device: torch.device, *, master_addr: str, master_port: int,
                       rank: int, world_size: int) -> None:
    """Joins the shards' process group over TCP at ``master_addr:master_port``."""
    dist.init_process_group(
        process_group_backend(device),
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=5),
    )
