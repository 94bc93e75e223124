"""The CUDA path's logic, checked on CPU with what needs a GPU swapped out.

What can go wrong there without any GPU test noticing: the host's own values (a step's
counts, the lost flag) sent to the device and read back for their all-reduce, the wrong
process-group backend for a device, placement bundles that ask for no GPU (or for two
per GPU when co-located), a layout needing more GPUs than the cluster has (Ray would
wait forever), the IPC transport's serialisation switch, NVML sampling a GPU by index
(the wrong one under CUDA_VISIBLE_DEVICES), the engine's dtype split from the trainer's,
an NCCL send with no deadline, ``trainer.compile`` finding no layer under FSDP2 or
compiling the per-sequence attention loop (one graph per sequence count), and the
attention row naming a kernel that does not run. (Phase times from CUDA events, without
a sync, and the host syncs of a step: tests/unit/test_trainer_speed.py; the weight
group's handshake and rendezvous: tests/unit/test_weight_join.py.)
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from uuid import UUID

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_packing import shard_batch
from transformers import Qwen2ForCausalLM

from async_rl.models.tiny_model import build_config
from buffers.common.config import ConfigError
from buffers.common.records import TrainSequence
from workers.common.spans import SpanRecorder
from workers.common.usage import UsageMeter, cuda_uuid
from workers.layout import assign_cpus
from workers.model_config import ModelConfig
from workers.placement import check_gpus, gpus_per_worker, role_bundles
from workers.rollout.config import RolloutConfig, Sampling, engine_dtype
from workers.rollout.engine import transport_environment
from workers.trainer.attention import attention_kwargs, use_packed_attention
from workers.trainer.config import TrainerConfig
from workers.trainer.device_setup import attention_dtype, compiles, decoder_layers, speed_up
from workers.trainer.ppo_update import StepLoss
from workers.trainer.process import process_group_backend
from workers.trainer.shard import TrainerShard
from workers.trainer.shard_roles import StepRoles
from workers.trainer.spec import ReferenceSpec, TrainerSpec
from workers.weights.config import WeightsConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
    shard = TrainerShard(TrainerSpec(
        rank=0, world_size=1, model=model, trainer=TrainerConfig(), seed=0, record_spans=False,
        sampling=Sampling(dtype="bfloat16")))
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


# -- compiled layers and the attention kernel ---------------------------------------------


@pytest.fixture
def tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(build_config())


@pytest.fixture
def fake_compile(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``torch.compile`` recording what it is asked to compile, compiling nothing."""
    compiled: list[Any] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    return compiled


def test_compile_finds_the_decoder_layers_after_fsdp2_renamed_their_class(
        tiny_model: Qwen2ForCausalLM, tmp_path: Path, fake_compile: list[Any]) -> None:
    import socket

    from workers.trainer.fsdp import build_sharded

    tiny_model.save_pretrained(tmp_path)
    layers = build_config().num_hidden_layers
    assert len(decoder_layers(tiny_model)) == layers
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        config = TrainerConfig(backend="fsdp2", compile=True)
        sharded = build_sharded(str(tmp_path), dtype=torch.float32,
                                device=torch.device("cpu"), trainer=config)
        found = decoder_layers(sharded)
        assert [type(m).__name__ for m in found] == ["FSDPQwen2DecoderLayer"] * layers
        assert speed_up(sharded, config, torch.device("cpu")) == layers
    finally:
        dist.destroy_process_group()
    assert len(fake_compile) == layers


def test_compile_is_on_by_default_only_where_the_attention_is_one_varlen_call(
        tiny_model: Qwen2ForCausalLM, fake_compile: list[Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU default (float32 compute) runs the per-sequence loop: compiling it would
    # unroll it, once per sequence count.
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(allow_tf32=False))
    monkeypatch.setattr(torch.backends, "cudnn", SimpleNamespace(allow_tf32=False))
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    layers = build_config().num_hidden_layers
    assert speed_up(tiny_model, TrainerConfig(), cuda) == 0
    assert speed_up(tiny_model, TrainerConfig(), cpu) == 0
    assert speed_up(tiny_model, TrainerConfig(packed=False, compute_dtype="bfloat16"),
                    cuda) == 0  # the padded reference layout
    assert fake_compile == []
    assert speed_up(tiny_model, TrainerConfig(compute_dtype="bfloat16"), cuda) == layers
    assert speed_up(tiny_model, TrainerConfig(compile=True), cuda) == layers
    assert compiles(TrainerConfig(), cuda, torch.float32) is False
    assert compiles(TrainerConfig(), cuda, torch.bfloat16) is True
    assert compiles(TrainerConfig(), cpu, torch.bfloat16) is False
    assert compiles(TrainerConfig(compile=True), cpu, torch.float32) is True
    assert compiles(TrainerConfig(compile=False), cuda, torch.bfloat16) is False
    fsdp_bf16 = TrainerConfig(backend="fsdp2", param_dtype="bfloat16")
    assert attention_dtype(tiny_model, fsdp_bf16) == torch.bfloat16
    assert attention_dtype(tiny_model, TrainerConfig()) == torch.float32
    assert attention_dtype(tiny_model.to(torch.bfloat16), TrainerConfig()) == torch.bfloat16


@pytest.mark.parametrize("attention", ["loop", "varlen"])
def test_a_compiled_layer_keeps_its_graphs_whatever_the_sequence_count(
        tiny_model: Qwen2ForCausalLM, attention: str, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    # The per-sequence loop (CPU, float32 on CUDA) with trainer.compile = true: traced,
    # it unrolled into one SDPA call per sequence and compiled again for every new
    # sequence count (5 micro-batches, 5 graphs). The varlen path (CUDA, bf16), a
    # traceable stand-in for its kernel here, never reads the lengths.
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from workers.trainer import attention as module

    if attention == "varlen":
        monkeypatch.setattr(module, "varlen_kernel", lambda device, dtype, windowed: (
            lambda q, k, v, cu, max_len, scale, window: q * cu[-1].to(q.dtype) / cu[-1]))
    use_packed_attention(tiny_model)
    layer, rotary = tiny_model.model.layers[0], tiny_model.model.rotary_emb
    counter = CompileCounter()
    torch._dynamo.reset()
    forward = torch.compile(layer.forward, dynamic=True, backend=counter)
    frames = []
    try:
        for lengths in [(5, 7), (3, 4, 6), (9, 2, 3, 4), (4, 4, 4, 4, 4), (2, 3, 2, 3, 2, 3)]:
            hidden = torch.randn(1, sum(lengths), tiny_model.config.hidden_size)
            positions = torch.cat([torch.arange(n) for n in lengths])[None]
            cu = torch.tensor(np.cumsum((0, *lengths)), dtype=torch.int32)
            with torch.no_grad():
                out = forward(hidden, position_embeddings=rotary(hidden, positions),
                              position_ids=positions, attention_mask=None,
                              **attention_kwargs(cu, max(lengths), lengths))
                want = layer(hidden, position_embeddings=rotary(hidden, positions),
                             position_ids=positions, attention_mask=None,
                             **attention_kwargs(cu, max(lengths), lengths))
            torch.testing.assert_close(out, want)
            frames.append(counter.frame_count)
    finally:
        torch._dynamo.reset()
    assert frames[0] >= 1
    assert frames == [frames[0]] * 5  # compiled once, for every sequence count


def test_the_kernel_label_names_what_runs_for_grouped_query_heads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.attention.varlen as varlen

    from workers.trainer import attention

    def without_gqa(*args: Any, is_causal: bool = False, scale: float | None = None
                    ) -> torch.Tensor:  # torch 2.11's signature: no enable_gqa
        return args[0]

    def with_gqa(*args: Any, scale: float | None = None,
                 window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False
                 ) -> torch.Tensor:
        return args[0]

    cuda = torch.device("cuda", 0)
    labels = {}
    for name, fake in (("2.11", without_gqa), ("newer", with_gqa)):
        monkeypatch.setattr(varlen, "varlen_attn", fake)
        monkeypatch.setattr(attention, "TORCH_VARLEN", attention._varlen_attn_call())
        kernel = attention.varlen_kernel(cuda, torch.bfloat16)
        labels[name] = (attention.kernel_name(kernel),
                        attention.kernel_name(kernel, gqa=True))
    assert labels == {
        "2.11": ("torch varlen_attn", "aten._flash_attention_forward"),
        "newer": ("torch varlen_attn", "torch varlen_attn")}
    assert attention.kernel_name(None, gqa=True) == "per-sequence loop"


def test_tf32_is_on_in_every_trainer_side_process_computing_float32_on_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Process-wide on purpose (docs/gpu.md); a reference or critic on a worker of its
    # own computed in full float32 while the policy it is compared with ran TF32.
    from workers.trainer import role_workers

    matmul, cudnn = SimpleNamespace(allow_tf32=False), SimpleNamespace(allow_tf32=False)
    monkeypatch.setattr(torch.backends.cuda, "matmul", matmul)
    monkeypatch.setattr(torch.backends, "cudnn", cudnn)
    monkeypatch.setattr(role_workers, "start_process", lambda device, cpu_ids: None)
    worker = role_workers.ReferenceWorker(ReferenceSpec(
        path="unused", rank=0, model=ModelConfig(path="unused"),
        trainer=TrainerConfig(compute_dtype="bfloat16"), temperature=1.0, record_spans=False))
    worker.device = torch.device("cuda", 0)
    worker._setup_process()
    assert not matmul.allow_tf32 and not cudnn.allow_tf32  # bf16 compute: nothing to do
    worker.trainer = TrainerConfig()
    worker._setup_process()
    assert matmul.allow_tf32 and cudnn.allow_tf32
