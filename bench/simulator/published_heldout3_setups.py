"""A third held-out set (2026-12-07): published weight-sync times this project never
predicted, the setups the simulator predicts them with, and every assumption where the
sources are silent, written down and committed before any of them was predicted.

Development data: ``published_scale_setups``, ``published_heldout_setups`` and
``published_heldout2_setups`` (forty-six figures; the terms of 2026-12-07's second round,
the "stage_heads" and "host_replica" weight paths and ``host_copy_bandwidth``, were built
on the last). Nothing here was used to build or tune anything; the terms, hardware files
and constants (``TENSOR_S``) are as committed before this module.

The rule, fixed before the search: every figure found on 2026-12-07 that reports the
time of one weight synchronisation (trainer to inference engines) of a model of at least
30B parameters, dense or a mixture of experts, on GPUs with a shipped hardware file (H100,
H800, H20, H200, A100), with the GPU type stated (or stated for the same feature by its
follow-up pull request), the trainer's and the engines' GPU counts stated or following
from the layouts given, that no development module predicts and that is not a
re-measurement of a development setup; one figure per source row (a range: its middle),
and of several implementations of one setup the newest. Left out by the rule: models
under 30B; verl issue 5311's DeepSeek-V3.1 rows (GPU type not stated); NeMo RL pull
request 638's colocated DeepSeek-V3 refit and pull request 3166's Nemotron Nano refit
(GPU type and counts not stated); NeMo RL pull request 2413's DeepSeek-V3 row (an older
implementation of the reshard design doc's row, kept); pull request 2971's further
Qwen3-30B-A3B layouts (the design doc's rows of the same model, method and precision
kept); NeMo RL's refit bandwidth calculator's anchors (no layouts); Moonshot's
"about 20 s" for Kimi-K2 on thousands of GPUs (a headline, not a figure); a first sync
through a debugging path (Modal's training-gym, 270 s); GB200, GB300, B200 rows. No step
time is in the set: the step-time sources found either re-measure development recipes
(NeMo RL v0.5's rows), publish no response lengths (verl's Qwen3-30B-A3B on H20) or GPU
counts (LlamaRL), or train with a CPU optimizer the simulator does not model (verl's
DeepSeek-V3 on 96 H20s, parameters, gradients and Adam offloaded).

Sources:

- verl's delta weight sync (verl-project/verl, docs/advance/delta_weight_sync.md,
  "Measured results", at 1dda039b9): H100 nodes, GSM8K GRPO, verl V1 ``separate_async``,
  SGLang rollout, the per-step steady-state sync: ``nccl`` (the full broadcast: full
  tensors materialized, staged on rank 0, broadcast over NCCL, loaded through SGLang's
  same-GPU ``update_weights_from_tensor``) and ``delta_sharded`` (each rank diffs its own
  shard against a pinned host snapshot, the changed (position, value) pairs gathered to
  rank 0 and broadcast in buckets, written in place); parameter and optimizer offload on
  unless noted. Its second table (A100/A800 80GB, ``one_step_off_policy``, offload off):
  the Qwen3-30B-A3B row.
- NeMo RL's NCCL reshard refit (NVIDIA-NeMo/RL, docs/design-docs/nccl-reshard-refit.md,
  "Expected Performance", at 7ea279abf): the H100 rows of models of 30B or more:
  each training rank sends its shard and each generation rank receives its own shard
  (the FFN and expert weights, 93-98% of the bytes; the rest a packed broadcast).
- NeMo RL pull request 2413 ("NCCL Xfer based refit integration", 2026-05-05, the
  table repeated in pull request 2808; DGX-H100 per its follow-up, pull request 2971):
  Qwen3-235B-A22B and Nemotron-3 Super.
- slime's v0.1.0 release notes (THUDM/slime, docs/en/blogs/release_v0.1.0.md):
  GLM-4.5 355B-A32B colocated, a sync in 48 s in BF16 and 100 s with FP8 blockwise
  quantization; the setup from docs/en/examples/glm4.5-355B-A32B.md and its script at
  the same commit (64 H100s, Megatron TP8 PP4 CP2 EP16, SGLang engines of 32 GPUs).
- Perplexity's first weight-transfer post (Lequn Chen, "Journey to 2-second Inter-node
  RL Weight Transfer", 2025-09-07, https://le.qun.ch/en/blog/2025/09/07/rl-weight-transfer):
  Qwen3-235B-A22B trained in BF16 on 128 H100s, served in FP8 on 32, RDMA WRITE point to
  point from every training GPU: 2 s.

Assumptions, fixed before any prediction:

- hardware: the shipped h100 file (one 400 Gb/s NIC a GPU, 50 GB/s; AWS p5's EFA is
  3,200 Gb/s a node, the same a GPU) and a100 for the A100/A800 row (its file's 25 GB/s
  NIC); one rail;
- verl ``nccl``: the "gathered" path (as the development set takes verl's NCCL
  checkpoint engine): the state gathered over the trainer's devices (``holders``: every
  trainer GPU), staged, broadcast to every rollout GPU (each hands its copy to its SGLang
  worker), ``TENSOR_S`` on one side (the per-tensor full export); the offload's paging of
  the parameters back to the devices is not counted (it is what the offload-on and
  offload-off rows differ by);
- verl ``delta_sharded``: the "direct" path (no full gather: the diffs are shard-local)
  carrying the changed elements alone, each an int32 position and a BF16 value (6 bytes
  a changed parameter: ``version_fraction`` = 3 x the changed share at 2 bytes a
  parameter), the changed share 2% for the dense models (the doc's 1-3%) and 0.035% for
  the mixtures of experts (its 0.02-0.05% for the 235B; taken for the 30B too); buckets,
  no per-tensor cost; the diff against the host snapshot is not counted;
- verl's GPU counts from the placements: 2+2 nodes 16 trainer and 16 rollout GPUs, 4+4
  32 and 32, 1+1 8 and 8, 8+2 64 and 16;
- NeMo RL's reshard and Xfer refits: the "p2p" path (each generation GPU receives its
  shard from the trainer's GPUs, all at once; the misc part's packed broadcast counted at
  the same rate), no per-tensor cost; GPU counts from the mappings: DeepSeek-V3 256 to
  8 engines of 32; Qwen3.5-397B-A17B (TP8 x PP8 x EP32: at least 256) 256 to 16 engines of
  16; Qwen3-30B-A3B BF16 16 to 2 engines of 8, FP8 16 to 8 engines of 2 (trained in
  blockwise FP8: the version native, 1 byte); Qwen3-235B-A22B (TP4 x PP8 x EP16, DP4) 128
  to 16 engines of 8; Nemotron-3 Super (about 120B; EP8 x TP8 x PP2 x DP2) 32 to 2 engines
  of 8;
- slime colocated: the time-shared reload as the development set's slime row takes it
  (``path = "time"``: the version moved within the engines' devices), ``TENSOR_S`` on
  both sides (Megatron's per-tensor gather, SGLang's loads), two engines of 32 GPUs; the
  FP8 row's version at 1 byte converted from BF16 on the trainer's devices;
- Perplexity: the "p2p" path as the development set's Kimi-K2 row (the FP8 version
  converted from BF16 by the trainer's devices), the 32 inference GPUs as 4 engines of 8
  (the post gives no layout; 235 GB of FP8 fits one node of 8);
- the models: Qwen2.5-32B 32.8B (64 layers), Qwen2.5-72B 72.7B (80 layers), Qwen3-30B-A3B
  30.5B, Qwen3-235B-A22B 235B, GLM-4.5 355B (92 layers, 89 with 160 experts), DeepSeek-V3
  671B, Qwen3.5-397B-A17B 397B, Nemotron-3 Super 120B; tensors counted where a per-tensor
  cost applies.
"""

from __future__ import annotations

from async_rl.sim.version_stages import version_tensors
from bench.simulator.published_heldout2_setups import QWEN3_30B, QWEN3_235B
from bench.simulator.published_scale_setups import NIC, TENSOR_S, WeightSync

A100_NIC = 25e9
"""The a100 file's interconnect (one 200 Gb/s NIC a GPU)."""
DENSE_CHANGED = 0.02
MOE_CHANGED = 0.00035
DELTA_BYTES_RATIO = 3
"""A changed parameter's int32 position and BF16 value (6 bytes) over its 2 BF16 bytes."""
QWEN25_32B_TENSORS = version_tensors(layers=64, moe_layers=0, experts=0)
QWEN25_72B_TENSORS = version_tensors(layers=80, moe_layers=0, experts=0)
GLM45_TENSORS = version_tensors(layers=92, moe_layers=89, experts=160)


def _verl(name: str, parameters: float, tensors: int, *, trainer: int, rollout: int,
          nccl_s: float, delta_s: float, changed: float, hardware: str = "h100",
          interconnect: float = NIC) -> tuple[WeightSync, WeightSync]:
    """A row of verl's table: the full broadcast and the sharded delta."""
    full = WeightSync(
        name=f"{name}, nccl", framework="verl", parameters=parameters, bytes_per_parameter=2,
        hardware=hardware, path="gathered", holders=trainer, trainer_devices=trainer,
        engine_devices=1, receivers=rollout, interconnect=interconnect, tensors=tensors,
        tensor_s=TENSOR_S, published_s=nccl_s)
    delta = WeightSync(
        name=f"{name}, delta_sharded", framework="verl", parameters=parameters,
        bytes_per_parameter=2, hardware=hardware, path="direct", trainer_devices=trainer,
        engine_devices=1, receivers=rollout, interconnect=interconnect,
        fraction=DELTA_BYTES_RATIO * changed, published_s=delta_s)
    return full, delta


def _reshard(name: str, parameters: float, *, trainer: int, engines: int, engine_devices: int,
             published_s: float, framework: str = "NeMo RL reshard",
             fp8: bool = False) -> WeightSync:
    """NeMo RL's shard-to-shard refit: every generation GPU receives its shard."""
    return WeightSync(
        name=name, framework=framework, parameters=parameters,
        bytes_per_parameter=1 if fp8 else 2, native=fp8, hardware="h100", path="p2p",
        trainer_devices=trainer, engine_devices=engine_devices, receivers=engines,
        interconnect=NIC, published_s=published_s)


HELDOUT3_SYNCS = (
    *_verl("Qwen2.5-32B, 16 -> 16 H100, offload on", 32.8e9, QWEN25_32B_TENSORS,
           trainer=16, rollout=16, nccl_s=17.9, delta_s=11.55, changed=DENSE_CHANGED),
    *_verl("Qwen2.5-32B, 16 -> 16 H100, offload off", 32.8e9, QWEN25_32B_TENSORS,
           trainer=16, rollout=16, nccl_s=14.2, delta_s=6.2, changed=DENSE_CHANGED),
    *_verl("Qwen2.5-72B, 32 -> 32 H100 (4 x TP8)", 72.7e9, QWEN25_72B_TENSORS,
           trainer=32, rollout=32, nccl_s=28.8, delta_s=12.5, changed=DENSE_CHANGED),
    *_verl("Qwen3-30B-A3B, 8 -> 8 H100 (VeOmni EP8)", QWEN3_30B.parameters,
           QWEN3_30B.tensors, trainer=8, rollout=8, nccl_s=32.2, delta_s=7.1,
           changed=MOE_CHANGED),
    *_verl("Qwen3-235B-A22B, 64 -> 16 H100 (EP8 x FSDP8, TP16)", QWEN3_235B.parameters,
           QWEN3_235B.tensors, trainer=64, rollout=16, nccl_s=256.0, delta_s=13.15,
           changed=MOE_CHANGED),
    *_verl("Qwen3-30B-A3B, 16 -> 16 A100 (FSDP2 x EP8)", QWEN3_30B.parameters,
           QWEN3_30B.tensors, trainer=16, rollout=16, nccl_s=43.43, delta_s=8.07,
           changed=MOE_CHANGED, hardware="a100", interconnect=A100_NIC),
    _reshard("DeepSeek-V3, 256 (PP16 x EP16) -> 8 x TP32", 671e9, trainer=256, engines=8,
             engine_devices=32, published_s=2.61),
    _reshard("Qwen3.5-397B-A17B, 256 (TP8 x PP8 x EP32) -> 16 x TP16", 397e9, trainer=256,
             engines=16, engine_devices=16, published_s=2.07),
    _reshard("Qwen3-30B-A3B BF16, 16 (EP8 x PP2) -> 2 x TP8", QWEN3_30B.parameters,
             trainer=16, engines=2, engine_devices=8, published_s=0.87),
    _reshard("Qwen3-30B-A3B FP8, 16 (EP8 x DP2) -> 8 x TP2", QWEN3_30B.parameters,
             trainer=16, engines=8, engine_devices=2, published_s=3.45, fp8=True),
    _reshard("Qwen3-235B-A22B, 128 (TP4 x PP8 x EP16) -> 16 x TP8", QWEN3_235B.parameters,
             trainer=128, engines=16, engine_devices=8, published_s=4.705,
             framework="NeMo RL Xfer"),
    _reshard("Nemotron-3 Super, 32 (EP8 x TP8 x PP2 x DP2) -> 2 x TP8", 120e9, trainer=32,
             engines=2, engine_devices=8, published_s=1.80, framework="NeMo RL Xfer"),
    WeightSync(name="GLM-4.5 355B BF16, colocated, 64 H100, 2 x 32-GPU engines",
               framework="slime", parameters=355e9, bytes_per_parameter=2, hardware="h100",
               path="time", trainer_devices=64, engine_devices=32, receivers=2,
               interconnect=NIC, tensors=GLM45_TENSORS, tensor_s=2 * TENSOR_S,
               published_s=48.0),
    WeightSync(name="GLM-4.5 355B FP8, colocated, 64 H100, 2 x 32-GPU engines",
               framework="slime", parameters=355e9, bytes_per_parameter=1, hardware="h100",
               path="time", trainer_devices=64, engine_devices=32, receivers=2,
               interconnect=NIC, tensors=GLM45_TENSORS, tensor_s=2 * TENSOR_S,
               published_s=100.0),
    WeightSync(name="Qwen3-235B-A22B, 128 BF16 -> 32 FP8 H100 (4 x 8)",
               framework="Perplexity RDMA", parameters=QWEN3_235B.parameters,
               bytes_per_parameter=1, hardware="h100", path="p2p", trainer_devices=128,
               engine_devices=8, receivers=4, interconnect=NIC, published_s=2.0),
)
"""Twenty-one weight-sync times of five frameworks (verl's full broadcast and sharded
delta, NeMo RL's reshard and Xfer refits, slime's colocated update, Perplexity's RDMA
writes), validation only."""
