"""The CUDA path's logic, checked on CPU with what needs a GPU swapped out.

What can go wrong there without any GPU test noticing: the host's own values (a step's
counts, the lost flag) sent to the device and read back for their all-reduce, the wrong
process-group backend for a device, placement bundles that ask for no GPU (or for two
per GPU when co-located), a layout needing more GPUs than the cluster has (Ray would
wait forever), the IPC transport's serialisation switch, NVML sampling a GPU by index
(the wrong one under CUDA_VISIBLE_DEVICES), the engine's dtype split from the trainer's,
and an NCCL send with no deadline. (Phase times from CUDA events, without a sync, and
the host syncs of a step: tests/unit/test_trainer_speed.py; the weight group's
handshake and rendezvous: tests/unit/test_weight_join.py.)
"""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace
from typing import Any
from uuid import UUID

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_packing import shard_batch

from buffers.config import ConfigError
from buffers.records import TrainSequence
from workers.layout import assign_cpus
from workers.model_config import ModelConfig
from workers.placement import check_gpus, gpus_per_worker, role_bundles
from workers.rollout.config import RolloutConfig, Sampling, engine_dtype
from workers.rollout.engine import transport_environment
from workers.spans import SpanRecorder
from workers.trainer.config import TrainerConfig
from workers.trainer.ppo_update import StepLoss
from workers.trainer.process import process_group_backend
from workers.trainer.roles import StepRoles
from workers.trainer.shard import TrainerShard
from workers.usage import UsageMeter, cuda_uuid
from workers.weights.config import WeightsConfig


def test_each_device_gets_the_backend_that_accepts_its_tensors() -> None:
    # On CUDA, gloo beside NCCL reduces the values the host holds (counts, flags,
    # moments) where they are.
    assert process_group_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_the_host_values_of_a_step_are_all_reduced_on_the_host(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's counts and lost flag are the host's: reduced by the group's CPU backend,
    never copied to the device and read back (two waits for the device each). The
    shard's device is "meta" here, standing in for CUDA: a tensor sent there would
    have no values to read back."""
    reduced: list[torch.Tensor] = []

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        reduced.append(tensor)
        tensor.mul_(2)  # as if a second shard held the same counts

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    meta = torch.device("meta")
    config = TrainerConfig(num_shards=2)
    losses = StepLoss(config=config, model=torch.nn.Identity(), module=torch.nn.Identity(),
                      device=meta, world_size=2, packed=True, temperature=1.0,
                      max_response_tokens=8)
    seq = TrainSequence(prompt_token_ids=np.ones(2, np.int32),
                        completion_token_ids=np.ones(7, np.int32),
                        behaviour_logprobs=np.zeros(7, np.float32), advantage=1.0)
    norms, lost = losses.agree([[(seq,)], [(), ()]], lost=False)
    assert not lost
    assert [(n.tokens, n.sequences) for n in norms] == [(14, 2), (0, 0)]
    assert losses.agree([[()]], lost=True)[1]
    spans = SpanRecorder(worker="trainer-0", role="trainer", rank=0, device="meta",
                         enabled=False)
    roles = StepRoles(trainer=config, losses=losses, device=meta, world_size=2,
                      temperature=1.0, reference=None, critic=None, spans=(spans, spans))
    batch, _ = shard_batch([[seq]])
    assert roles.prepare(batch, None)  # this shard lost its groups: every shard knows
    assert len(reduced) == 3
    assert all(t.device.type == "cpu" for t in reduced)


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


def test_too_few_gpus_for_the_layout_is_a_config_error_before_placement() -> None:
    split = assign_cpus(1, 1, 1, 1, available=(0, 1))
    check_gpus(split, 0)  # the CPU path asks for no GPU
    check_gpus(split, 2)
    with pytest.raises(ConfigError) as info:
        check_gpus(split, 1)
    assert str(info.value) == (
        "config error: run.colocate = false: 1 rollout worker(s) and 1 trainer shard(s) "
        "need 2 GPUs (one each), and the cluster has 1; set run.colocate = true (rollout "
        "worker i and trainer shard i share GPU i)")
    check_gpus(assign_cpus(1, 1, 1, 1, available=(0, 1), colocated=True), 1)
    with pytest.raises(ConfigError) as info:
        check_gpus(assign_cpus(2, 1, 2, 1, available=(0, 1), colocated=True), 1)
    assert str(info.value).endswith("need 2 GPU(s) (pair i shares GPU i), and the cluster has 1")


def test_only_the_ipc_transport_allows_vllm_insecure_serialization() -> None:
    assert transport_environment("ipc") == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    assert transport_environment("nccl") == {} and transport_environment("gloo") == {}


def test_nvml_samples_the_gpu_cuda_names_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    uuid = UUID("12345678-1234-5678-1234-567812345678")
    asked: list[int] = []

    def properties(ordinal: int) -> SimpleNamespace:
        asked.append(ordinal)
        return SimpleNamespace(uuid=uuid)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert cuda_uuid(1) == f"GPU-{uuid}" and asked == [1]
    looked_up: list[str] = []
    sampled = threading.Event()

    def handle_by_uuid(name: str) -> str:
        looked_up.append(name)
        return "handle"

    def utilization(handle: str) -> SimpleNamespace:
        sampled.set()
        return SimpleNamespace(gpu=40)

    fake = SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetHandleByUUID=handle_by_uuid,
        nvmlDeviceGetHandleByIndex=lambda i: pytest.fail("looked up by index"),
        nvmlDeviceGetUtilizationRates=utilization)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    meter = UsageMeter(gpu_uuid=cuda_uuid(0), period_s=0.01)
    assert sampled.wait(5)
    meter.close()
    assert looked_up == [f"GPU-{uuid}"]
    assert meter.read().gpu_samples >= 1


def test_the_engine_dtype_defaults_to_the_model_and_published_weights_are_cast_to_it(
) -> None:
    model = ModelConfig(path="unused", dtype="float32")
    assert engine_dtype(RolloutConfig(), model) == "float32"
    assert engine_dtype(RolloutConfig(dtype="bfloat16"), model) == "bfloat16"
    shard = TrainerShard(rank=0, world_size=1, model=model, trainer=TrainerConfig(), seed=0,
                         record_spans=False, sampling=Sampling(dtype="bfloat16"))
    assert shard.rollout_dtype == "bfloat16"
    from workers.weights.sender import WeightSender

    sender = WeightSender(WeightsConfig(), address="127.0.0.1", device=torch.device("cpu"),
                          dtype=torch.bfloat16)
    master = torch.randn(4, 8)
    assert sender.snapshot(1, [("w", master)]) == master.numel() * 2  # half the bytes
    ((name, sent),) = sender._snapshots[1]
    assert name == "w" and sent.dtype == torch.bfloat16
    torch.testing.assert_close(sent, master.to(torch.bfloat16), rtol=0, atol=0)


def test_an_nccl_send_that_hangs_fails_at_its_deadline() -> None:
    from workers.weights.group_client import GroupClient
    from workers.weights.sender import WeightSender, _Group

    abandoned: list[str] = []
    actor = SimpleNamespace(abandon_weight_update=SimpleNamespace(remote=abandoned.append))
    stuck = threading.Event()
    engine = SimpleNamespace(send_weights=lambda: stuck.wait(30), shutdown=lambda: pytest.fail(
        "a stuck engine is not shut down (that could block too)"))
    sender = WeightSender(WeightsConfig(transport="nccl", timeout_s=0.2),
                          address="127.0.0.1", device=torch.device("cpu"))
    sender.connect(0, actor)
    client = GroupClient([(0, actor)], 0.2, sender_bounds_transfer=False)
    sender._group = _Group(client, engine)  # type: ignore[arg-type]
    sender._rebuild = False  # as if built at an earlier send
    sender.snapshot(1, [("w", torch.zeros(2))])
    began = time.monotonic()
    delivery = sender.send(1, [0])
    assert time.monotonic() - began < 5
    stuck.set()
    assert delivery.failed == [0] and delivery.timings == [] and delivery.attempts == 1
    assert len(abandoned) == 1 and "longer than weights.timeout_s (0.2s)" in abandoned[0]
    assert sender._group is None  # rebuilt at the next send
