"""FSDP2 with trainer.offload on several devices: the process group needs a CPU backend.

CUDA's group is NCCL, a backend for the cuda device type only; with
``CPUOffloadPolicy`` the sharded gradients are CPU tensors, and ``clip_grad_norm_``
all-reduces their norms there. On a CPU machine the same group is built with gloo
registered for the cuda device type alone ("cuda:gloo"): the clip fails as on GPUs, and
the backend string ``process_group_backend`` makes for an accelerator (gloo standing in
for NCCL) lets it through. Two real processes; nothing here needs a GPU.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from script_modules import load_script

from workers.trainer.process import process_group_backend

ACCELERATOR_ONLY = "cuda:gloo"
"""A group with no CPU backend, as "nccl" is on CUDA (gloo registered for cuda only)."""


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _inputs() -> torch.Tensor:
    return torch.arange(24.0).reshape(3, 8) / 10


def _reference_norm() -> float:
    model = _model()
    model(_inputs()).square().sum().backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))


def _shard(rank: int, rendezvous: str, results: mp.SimpleQueue) -> None:  # type: ignore[type-arg]
    """One of two ranks: the default group is the accelerator's backend string; a clip over a
    group of the accelerator's backend alone runs first, then FSDP2's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard

    backend = process_group_backend(torch.device("cuda"), accelerator_backend="gloo")
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank,
                            world_size=2)
    try:
        no_cpu = DeviceMesh.from_group(dist.new_group(backend=ACCELERATOR_ONLY), "cpu")
        weight = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 8), no_cpu, [Shard(0)]))
        weight.grad = DTensor.from_local(torch.ones(4, 8), no_cpu, [Shard(0)])
        try:
            torch.nn.utils.clip_grad_norm_([weight], 1.0)
            without = "clipped"
        except RuntimeError as err:
            without = str(err)
        model = _model()
        offload = CPUOffloadPolicy(pin_memory=False)
        mesh = init_device_mesh("cpu", (2,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh, offload_policy=offload)
        fully_shard(model, mesh=mesh, offload_policy=offload)
        model(_inputs()).square().sum().backward()
        grads = [p.grad.to_local() for p in model.parameters()]  # type: ignore[union-attr]
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
        results.put((rank, backend, without, {str(g.device) for g in grads}, norm))
    finally:
        dist.destroy_process_group()


def test_backend_strings() -> None:
    assert process_group_backend(torch.device("cuda")) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"  # gloo takes CPU tensors


def test_clipping_offloaded_gradients_needs_the_cpu_backend(tmp_path: Path) -> None:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.spawn(_shard, args=(str(tmp_path / "rendezvous"), results), nprocs=2)
    got = sorted(results.get() for _ in range(2))
    assert [rank for rank, *_ in got] == [0, 1]
    expected = _reference_norm()
    for _, backend, without, devices, norm in got:
        assert backend == "cpu:gloo,cuda:gloo"
        assert without == "No backend type associated with device type cpu"
        assert devices == {"cpu"}  # the gradients really are offloaded
        assert norm == pytest.approx(expected, rel=1e-5)  # the whole model's, both ranks


def test_the_gpu_check_row_runs_the_same_groups_on_cpu() -> None:
    """The GPU check's offload row (bench/trainer/gpu_rows.py), with gloo standing in for NCCL:
    one rank."""
    gpu_rows = load_script("bench/trainer/gpu_rows.py", "gpu_rows_offload")
    rows = gpu_rows.offload_clip_check(torch.device("cpu"), accelerator_backend="gloo",
                                       port=_free_port())
    assert len(rows) == 1
    name, result, figures = rows[0]
    assert name == "FSDP2 offload clip (cpu:gloo,cuda:gloo, 1 rank)"
    assert result == "ok", figures
    assert "grads on cpu" in figures
    assert figures.endswith("CPU all-reduce: sums 1, with gloo alone fails (No backend type "
                            "associated with device type cpu)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
