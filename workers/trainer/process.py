"""A trainer shard's process: the cores it runs on and the process group it joins.

Owns: pinning the process to its cores (so that roles on one CPU machine behave like
separate devices), the device label its span tracks carry and its usage meter (what a
trainer shard and a role's worker of its own share), and the choice of collective
backend per device (a CPU backend beside the accelerator's, for host values and FSDP2's
offloaded gradients).
Knows nothing about the model, the optimizer or Ray.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.common.usage import UsageMeter, cuda_uuid


def pin_to_cpus(cpu_ids: tuple[int, ...]) -> None:
    """Gives this process its own cores so roles behave like separate devices."""
    if cpu_ids and hasattr(os, "sched_setaffinity"):
        available = os.sched_getaffinity(0)
        wanted = {c for c in cpu_ids if c in available} or available
        os.sched_setaffinity(0, wanted)
        torch.set_num_threads(len(wanted))


def device_label(device: torch.device, cpu_ids: tuple[int, ...]) -> str:
    """What this process computes on, as its span tracks name it: ``cuda:N`` or
    ``cpu:<its cores>``."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu:" + ",".join(map(str, cpu_ids))


def start_process(device: torch.device, cpu_ids: tuple[int, ...]) -> UsageMeter:
    """Pins this process to its cores; returns its usage meter (NVML's on CUDA)."""
    pin_to_cpus(cpu_ids)
    return UsageMeter(gpu_uuid=cuda_uuid(torch.cuda.current_device())
                      if device.type == "cuda" else None)


def process_group_backend(device: torch.device, *, accelerator_backend: str = "nccl") -> str:
    """The backend string of the shards' process group on ``device``.

    gloo on CPU. On an accelerator its own backend (``accelerator_backend``: NCCL for
    CUDA) for the device's tensors, with gloo beside it for CPU tensors
    ("cpu:gloo,cuda:nccl"); each collective goes to the backend of its tensors' device.
    The CPU side serves two things. Values the host holds and needs back (a step's
    token counts, the lost flag, GAE's moments) are reduced where they are: through
    NCCL they would be copied to the device and read back, two waits for the device
    each. And with FSDP2's ``CPUOffloadPolicy`` (trainer.offload) the sharded
    gradients live in CPU memory, where ``clip_grad_norm_`` all-reduces their norms: a
    group of NCCL alone fails with "No backend type associated with device type cpu"
    (pytorch#148532).
    """
    if device.type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device.type}:{accelerator_backend}"


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
