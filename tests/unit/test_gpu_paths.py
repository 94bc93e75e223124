"""The CUDA path's logic, checked on CPU with what needs a GPU swapped out.

What can go wrong there without any GPU test noticing: a collective's tensor left on the
CPU (NCCL accepts only CUDA tensors: the first multi-shard step would fail), the wrong
process-group backend for a device, placement bundles that ask for no GPU (or for two
per GPU when co-located).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from buffers.records import TrainSequence
from workers.model_config import ModelConfig
from workers.placement import assign_cpus, gpus_per_worker, role_bundles
from workers.trainer.config import TrainerConfig
from workers.trainer.ppo_update import StepLoss
from workers.trainer.shard import TrainerShard, process_group_backend


def test_each_device_gets_the_backend_that_accepts_its_tensors() -> None:
    assert process_group_backend(torch.device("cuda", 0)) == "nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


@pytest.fixture
def tensors_default_to_meta() -> Iterator[None]:
    """Any tensor made without an explicit device lands on "meta", so a collective fed
    one is caught even though the shard's own device here is the CPU."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def test_the_step_all_reduce_is_placed_on_the_shard_device(
    monkeypatch: pytest.MonkeyPatch, tensors_default_to_meta: None
) -> None:
    reduced: list[torch.Tensor] = []

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        reduced.append(tensor)
        tensor.mul_(2)  # as if a second shard held the same counts

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    shard = TrainerShard(rank=0, world_size=2, model=ModelConfig(path="unused"),
                         trainer=TrainerConfig(num_shards=2), seed=0, record_spans=False)
    losses = StepLoss(config=shard.config, model=torch.nn.Identity(),
                      module=torch.nn.Identity(), device=shard.device, world_size=2,
                      packed=True, temperature=1.0, max_response_tokens=8)
    seq = TrainSequence(prompt_token_ids=np.ones(2, np.int32),
                        completion_token_ids=np.ones(7, np.int32),
                        behaviour_logprobs=np.zeros(7, np.float32), advantage=1.0)
    norms, lost = losses.agree([[(seq,)], [(), ()]], lost=False)
    assert not lost
    assert [(n.tokens, n.sequences) for n in norms] == [(14, 2), (0, 0)]
    assert losses.agree([[()]], lost=True)[1]
    assert len(reduced) == 2
    assert all(t.device == shard.device for t in reduced)


def test_placement_bundles_ask_for_gpus_only_on_a_gpu_cluster() -> None:
    layout = assign_cpus(2, 1, 2, 2, available=(0, 1, 2, 3, 4, 5))
    assert gpus_per_worker(0, colocated=False) == 0.0
    cpu_only = role_bundles(layout, 1, 2, gpus=gpus_per_worker(0, colocated=False))
    assert cpu_only == {"rollout": [{"CPU": 1.0}] * 2, "trainer": [{"CPU": 2.0}] * 2}

    gpus = gpus_per_worker(8, colocated=False)
    assert gpus == 1.0
    split = role_bundles(layout, 1, 2, gpus=gpus)
    assert split["rollout"] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert split["trainer"] == [{"CPU": 2.0, "GPU": 1.0}] * 2


def test_colocated_bundles_share_one_gpu_between_the_two_roles() -> None:
    layout = assign_cpus(2, 1, 2, 1, available=(0, 1), colocated=True)
    gpus = gpus_per_worker(2, colocated=True)
    assert gpus == 0.5  # each actor takes half a GPU...
    bundles = role_bundles(layout, 1, 1, gpus=gpus)
    # ...and a bundle holds rollout worker i and trainer shard i: one whole GPU.
    assert bundles["rollout"] is bundles["trainer"]
    assert bundles["rollout"] == [{"CPU": 2.0, "GPU": 1.0}] * 2
