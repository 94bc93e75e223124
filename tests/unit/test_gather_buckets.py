"""FSDP2's bucket-by-bucket gather on one rank (a gloo group of one, in process): the
buckets' order, their bound, a parameter larger than a bucket alone in its own, plain
and sharded parameters alike, and a module without parameters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from workers.trainer.fsdp import gather_buckets


@pytest.fixture
def group_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def module(*sizes: int) -> torch.nn.Module:
    out = torch.nn.Module()
    for index, size in enumerate(sizes):
        out.register_parameter(f"p{index}", torch.nn.Parameter(torch.full((size,),
                                                                          float(index))))
    return out


def test_buckets_hold_every_parameter_in_order_within_the_bound(group_of_one: None) -> None:
    model = module(10, 20, 30, 100, 5)  # float32: 40, 80, 120, 400, 20 bytes
    buckets = list(gather_buckets(model, bucket_bytes=128))
    assert [[name for name, _ in b] for b in buckets] == [
        ["p0", "p1"], ["p2"], ["p3"], ["p4"]]  # p3 (400 bytes) alone
    for bucket in buckets:
        assert sum(t.numel() * 4 for _, t in bucket) <= 128 or len(bucket) == 1
    gathered = dict(pair for bucket in buckets for pair in bucket)
    assert all(torch.equal(gathered[n], p) for n, p in model.named_parameters())


def test_sharded_parameters_come_back_whole(group_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = fully_shard(torch.nn.Linear(8, 4), mesh=init_device_mesh("cpu", (1,)))
    assert isinstance(model.weight, DTensor)
    (bucket,) = list(gather_buckets(model, bucket_bytes=1 << 20))
    assert [(n, t.shape, type(t)) for n, t in bucket] == [
        ("weight", torch.Size([4, 8]), torch.Tensor), ("bias", torch.Size([4]), torch.Tensor)]


def test_a_module_without_parameters_yields_nothing(group_of_one: None) -> None:
    assert list(gather_buckets(torch.nn.Module(), bucket_bytes=64)) == []
