"""Published results at the scale people rent, the setups the simulator predicts them with,
and the assumptions where the sources are silent: written down before any prediction.

Since 2026-12-06 these fifteen figures are the DEVELOPMENT set: the terms their misses
pointed at were built on them (the "host" weight path, an FP8 checkpoint served as FP8,
tensor-by-tensor calls, a pipeline's fill and drain), and the setups below were changed to
use them (each change marked "development"). ``published_heldout_setups`` holds the
figures they were validated on.

Two kinds of figure:

- ``WEIGHT_SYNCS``: the seconds a framework takes to move one weight version into its
  inference engines, predicted by the stages of ``async_rl.sim.version_stages`` (the
  trainer's part, the transfer, the engines' load; or, colocated, an engine's reload);
- ``STEPS``: NeMo RL v0.4's mixture-of-experts rows, each run's total step time, simulated
  whole with the layouts the table gives (``async_rl.sim.parallel``).

Sources:

- Moonshot AI's checkpoint-engine README (MoonshotAI/checkpoint-engine, "Benchmark",
  vLLM v0.10.2rc1): "Update (Broadcast)" of six model and cluster pairs. The version sits
  in the host memory of every GPU of the cluster (a shard each); each bucket is copied to
  its GPU, broadcast among all the GPUs, and each engine copies its part.
- verl's checkpoint engine README (volcengine/verl, verl/checkpoint_engine/README.md,
  "Benchmark"): Qwen3-30B-A3B-Base, FSDP trainer of world size 2, 30 receiving rollout
  GPUs, 4 x 8 H100 with ConnectX-7 400 Gb/s, NCCL backend (all-gather, then broadcast):
  about 7 s.
- sglang issue 30848 (sgl-project/sglang, "MoE load_weights is quadratic"): verl with
  SGLang rollout disaggregated on H100s, Qwen3-30B-A3B, a full-broadcast sync per step
  measured at 55-63 s (the middle, 59 s, is the figure).
- slime issue 132 (THUDM/slime, "Update Weights Optimization for EPMOE and FP8"):
  Qwen3-30B-A3B in BF16 on 8 H200, SGLang TP 4, colocated (training and rollout on the
  same GPUs): about 8 s a weight update with the patch of 2025-08-05.
- NeMo RL's performance summary (NVIDIA-NeMo/RL, docs/about/performance-summary.md,
  "Nemo RL v0.4", DGX-H100, BF16, Megatron-core): the total step time of the Qwen3-30B-A3B,
  Qwen3-235B-A22B and DeepSeek V3 rows, on-policy and 1-step off.

Which were seen before: NeMo RL's Qwen3 rows were in this project's validation set
(``sim_published_unseen``: ratios within 10% for 30B-A3B, -72% for 235B; absolute step
times 2.8x short) and their misses are what the issue that built the parallelism model
cites; nothing was fitted on them, but they are not unseen. Everything else here (the
DeepSeek V3 rows, every weight-sync figure) is validation only.

Assumptions, the same for every setup, fixed before any prediction:

- the shipped hardware files unchanged (h100, h200, h20; an H800 is the h100 file with
  its NVLink at 200 GB/s each way, 400 GB/s both ways in NVIDIA's H800 brief);
- a broadcast within one node crosses NVLink (``intra_node_bandwidth``), one across nodes
  the NIC (``inter_node_bandwidth``): the setup's ``interconnect`` is the one it crosses;
- buckets of 16 MiB (the simulator's default) as the broadcast's pipeline unit;
- the checkpoint engine's version is already in host memory: the "direct" path, every
  GPU of the cluster a receiver (each receives the whole version, then keeps its part);
- verl's NCCL checkpoint engine and the verl + SGLang sync: the "gathered" path (FSDP's
  full tensors gathered, then broadcast from one rank);
- slime colocated: the time-shared reload (the version copied within the engine's
  devices) plus the hardware file's engine_reload_s (0);
- NeMo RL rows: as ``sim_published_unseen`` states them (log-normal responses, sigma 0.8,
  the row's average generated length as the mean, 128-token prompts; on-policy
  time-shared at max_staleness 0, 1-step off at 1 with half the GPUs generating), plus:
  the training layout [TP, CP, EP, PP] of the row as simulate.trainer_layout, generation
  TP as simulate.rollout_layout (no expert parallel in generation), the architecture from
  the models' config.json (layers, hidden size, MoE layers, experts per token), the old
  log-prob pass always (NeMo RL computes the policy's logprobs every step), no
  activation recompute, training at ``MOE_TRAIN_MFU`` (development, 2026-12-07);
  DeepSeek V3's 512 samples a step as 16 prompts x 32 samples, its KV bytes those of
  multi-head latent attention (61 layers x (512 + 64) x 2 bytes).
"""

from __future__ import annotations

import msgspec

from async_rl.sim.version_stages import version_tensors
from bench.simulator.sim_published_unseen import QWEN3_30B_A3B, QWEN3_235B_A22B, Model

GIB = 1 << 30
H800_NVLINK = 200e9
NIC = 50e9
QWEN3_30B_TENSORS = version_tensors(layers=48, moe_layers=48, experts=128)
MOE_TRAIN_MFU = 0.25
"""Development, 2026-12-07: the training MFU of a mixture of experts
(``moe_train_mfu``) for every step row: Megatron-Core's Qwen3-235B-A22B on 256 H100s in
BF16 reaches 167-276 TFLOP/s per GPU (NVIDIA's Megatron-MoE-ModelZoo,
best_practice/Qwen3), 245 in the layout nearest NeMo RL's (TP2, EP32, PP8): 0.25 of the
989 TFLOP/s peak; not fitted on these rows."""
TENSOR_S = 2e-4
"""Development, 2026-12-06: seconds per tensor and per side that moves a version tensor by
tensor (a per-tensor all-gather or broadcast call on the trainer's side, a per-tensor
IPC handle or loader call on the engine's): fitted on verl's checkpoint-engine benchmark
(7 s; its receivers load nothing, one side), then slime's colocated update pays it on
both sides (Megatron's per-tensor gather and serialisation, SGLang's per-tensor load)."""


class WeightSync(msgspec.Struct, frozen=True, kw_only=True):
    """One published weight-sync time and its setup."""

    name: str
    framework: str
    parameters: float
    bytes_per_parameter: float
    """Of the version (1: FP8)."""
    hardware: str
    path: str
    """simulate.weights_path; "time" for a colocated reload."""
    holders: int = 1
    """Trainer devices holding a slice of the state (gathered)."""
    trainer_devices: int = 1
    engine_devices: int
    receivers: int
    """Members of the broadcast that receive the whole version."""
    interconnect: float
    """Bytes/s of the link the broadcast crosses."""
    intra_node_bandwidth: float = 0.0
    """0: the hardware file's."""
    host_bandwidth: float = 0.0
    """0: the hardware file's (the "host" path's link up to a device)."""
    native: bool = False
    """The checkpoint is at the version's dtype already (FP8 served as FP8): no conversion
    (development, 2026-12-06)."""
    tensors: int = 0
    """Tensors of the version, each paying ``tensor_s`` (0: none counted)."""
    tensor_s: float = 0.0
    """Seconds per tensor where the framework moves the version tensor by tensor
    (development, 2026-12-06: ``TENSOR_S``)."""
    rails: int = 1
    """NIC rails a device's share stripes over (simulate.weights_rails; development,
    2026-12-07)."""
    stages: int = 1
    """The trainer's pipeline stages ("stage_heads", "host_replica"; development,
    2026-12-07, second round)."""
    fraction: float = 1.0
    """simulate.version_fraction: a delta version's share of the full one's bytes."""
    published_s: float


WEIGHT_SYNCS = (
    WeightSync(name="GLM-4.5-Air BF16, 8 H800, TP8", framework="checkpoint-engine",
               parameters=106e9, bytes_per_parameter=2, hardware="h100", path="host",
               engine_devices=8, receivers=8, interconnect=H800_NVLINK,
               intra_node_bandwidth=H800_NVLINK, published_s=3.94),
    WeightSync(name="Qwen3-235B-A22B BF16, 8 H800, TP8", framework="checkpoint-engine",
               parameters=235e9, bytes_per_parameter=2, hardware="h100", path="host",
               engine_devices=8, receivers=8, interconnect=H800_NVLINK,
               intra_node_bandwidth=H800_NVLINK, published_s=6.75),
    WeightSync(name="DeepSeek-V3.1 FP8, 16 H20, TP16", framework="checkpoint-engine",
               parameters=671e9, bytes_per_parameter=1, hardware="h20", path="host",
               native=True,
               engine_devices=16, receivers=16, interconnect=NIC, published_s=12.22),
    WeightSync(name="Kimi-K2 FP8, 16 H20, TP16", framework="checkpoint-engine",
               parameters=1.04e12, bytes_per_parameter=1, hardware="h20", path="host",
               native=True,
               engine_devices=16, receivers=16, interconnect=NIC, published_s=15.45),
    WeightSync(name="DeepSeek-V3.1 FP8, 256 H20, 16 x TP16", framework="checkpoint-engine",
               parameters=671e9, bytes_per_parameter=1, hardware="h20", path="host",
               native=True,
               engine_devices=16, receivers=256, interconnect=NIC, published_s=13.88),
    WeightSync(name="Kimi-K2 FP8, 256 H20, 16 x TP16", framework="checkpoint-engine",
               parameters=1.04e12, bytes_per_parameter=1, hardware="h20", path="host",
               native=True,
               engine_devices=16, receivers=256, interconnect=NIC, published_s=21.50),
    WeightSync(name="Qwen3-30B-A3B BF16, FSDP 2 -> 30 GPUs, 4 x 8 H100", framework="verl",
               parameters=30.5e9, bytes_per_parameter=2, hardware="h100", path="gathered",
               holders=2, trainer_devices=2, engine_devices=1, receivers=30,
               interconnect=NIC, tensors=QWEN3_30B_TENSORS, tensor_s=TENSOR_S,
               published_s=7.0),
    WeightSync(name="Qwen3-30B-A3B BF16, verl + SGLang disaggregated, H100",
               framework="verl", parameters=30.5e9, bytes_per_parameter=2, hardware="h100",
               path="gathered", holders=8, trainer_devices=8, engine_devices=1,
               receivers=8, interconnect=NIC, tensors=QWEN3_30B_TENSORS,
               tensor_s=2 * TENSOR_S, published_s=59.0),
    WeightSync(name="Qwen3-30B-A3B BF16, colocated, 8 H200, SGLang TP4", framework="slime",
               parameters=30.5e9, bytes_per_parameter=2, hardware="h200", path="time",
               engine_devices=4, receivers=2, interconnect=NIC, tensors=QWEN3_30B_TENSORS,
               tensor_s=2 * TENSOR_S, published_s=8.0),
)
"""The verl + SGLang row's trainer and engine sizes are not given: one node of 8 trainer
GPUs and 8 one-GPU engines across the network are assumed.

Development, 2026-12-06: the checkpoint engine's rows take the "host" path (its version
is registered in host memory; each bucket is copied up, broadcast and read by the
engines, pipelined), its FP8 rows serve the FP8 checkpoint as is (``native``); verl's and
slime's rows pay ``TENSOR_S`` a tensor on each side that moves the version tensor by
tensor (verl + SGLang: FSDP's per-tensor gather and SGLang's per-tensor loader, whose
quadratic cost in the issue is not modelled)."""


DEEPSEEK_V3 = Model(name="DeepSeek V3", parameters=671e9, active=37e9,
                    kv_bytes_per_token=61 * (512 + 64) * 2, attention_width=61 * 128 * 192)


class Architecture(msgspec.Struct, frozen=True, kw_only=True):
    layers: int
    hidden_size: int
    experts: int
    experts_per_token: int
    moe_layers: int


ARCHITECTURES = {
    QWEN3_30B_A3B.name: Architecture(layers=48, hidden_size=2048, experts=128,
                                     experts_per_token=8, moe_layers=48),
    QWEN3_235B_A22B.name: Architecture(layers=94, hidden_size=4096, experts=128,
                                       experts_per_token=8, moe_layers=94),
    DEEPSEEK_V3.name: Architecture(layers=61, hidden_size=7168, experts=256,
                                   experts_per_token=8, moe_layers=58),
}


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """One NeMo RL v0.4 row: (model, on-policy or not, GPUs, generation TP, training
    [TP, CP, EP, PP], maximum sequence, average generated length, prompts, published
    seconds)."""

    model: Model
    off_policy: bool
    gpus: int
    generate_tp: int
    train: tuple[int, int, int, int]
    max_length: int
    mean_response: float
    prompts: int
    published_s: float
    in_flight: bool = False
    seen: bool = True
    """In this project's validation set before (its miss known)."""
    staleness: int = 1
    """max_staleness of an off-policy row (its "N-step off")."""
    rollout_gpus: int = 0
    """GPUs generating in an off-policy row (0: half of them)."""
    label: str = ""
    """What the row's name shows beside its policy (e.g. its generation layout)."""


STEPS = (
    Step(model=QWEN3_30B_A3B, off_policy=False, gpus=32, generate_tp=4, train=(2, 1, 8, 1),
         max_length=4096, mean_response=3154, prompts=64, published_s=225.0),
    Step(model=QWEN3_30B_A3B, off_policy=True, gpus=32, generate_tp=2, train=(1, 1, 8, 2),
         max_length=4096, mean_response=3158, prompts=64, published_s=244.0, in_flight=True),
    Step(model=QWEN3_235B_A22B, off_policy=False, gpus=128, generate_tp=16,
         train=(2, 2, 16, 8), max_length=8192, mean_response=5671, prompts=16,
         published_s=506.0),
    Step(model=QWEN3_235B_A22B, off_policy=True, gpus=256, generate_tp=8,
         train=(4, 1, 16, 8), max_length=8192, mean_response=5691, prompts=16,
         published_s=241.0),
    Step(model=DEEPSEEK_V3, off_policy=False, gpus=256, generate_tp=32, train=(1, 1, 16, 16),
         max_length=1536, mean_response=745, prompts=16, published_s=154.0, seen=False),
    Step(model=DEEPSEEK_V3, off_policy=True, gpus=512, generate_tp=32, train=(1, 1, 16, 16),
         max_length=1536, mean_response=744, prompts=16, published_s=77.9, seen=False),
)
