"""Since 2026-12-07 these fifteen figures are DEVELOPMENT data: the terms their misses
pointed at were built on them (the "p2p" weight path, NIC rails, a mixture of experts'
training MFU) and the setups below were changed to use them (each change marked
"development", 2026-12-07); ``published_heldout2_setups`` holds the figures held out
since.

Published results held out from development (2026-12-06): figures this project never predicted
before, the setups the simulator predicts them with, and the assumptions where the sources
are silent, written down and committed before any of them was predicted (2026-12-06).

The development set is ``published_scale_setups`` (fifteen figures whose misses the terms
of 2026-12-06 were built on: the "host" weight path, an FP8 checkpoint served as FP8,
tensor-by-tensor calls at ``TENSOR_S``, a pipeline's fill and drain). Nothing here was
used to build or tune them; the terms, the hardware files and the constants are as
committed before this module.

How the figures were chosen (before predicting, not after): every figure found on
2026-12-06 that reports a weight-sync time or an RL step time of a mixture-of-experts
model of at least 30B parameters on a GPU this project has a hardware file for (H100,
H800 as the h100 file, H20, H200), run in BF16 (FP8 versions allowed), and is not a
re-measurement of a development setup in every term the simulator models. Left out for
that last reason: checkpoint-engine's newer "Update (Broadcast)" column (the same six
setups, re-measured), verl's NIXL checkpoint engine (~7 s, the development NCCL row's
setup), NeMo RL v0.6 rows whose model, GPUs and layouts equal a v0.4 row. Left out for
hardware: GB200, GB300 and Ascend rows; for precision: NeMo RL's FP8-training row; DAPO
rows (dynamic sampling generates an unknown surplus).

Sources:

- Moonshot AI's checkpoint-engine README (MoonshotAI/checkpoint-engine, README.md at
  415c320, "Benchmark", vLLM v0.10.2rc1): the "Update (P2P)" column: new instances
  receive the version from the host memory of existing ones through the Mooncake
  transfer engine (RDMA), at most two nodes (16 GPUs) updated, whatever the cluster.
- Perplexity, "Weight Transfer for RL Post-Training in under 2 seconds" (Sep 2025,
  https://research.perplexity.ai/articles/weight-transfer-for-rl-post-training-in-under-2-seconds,
  and its follow-up https://le.qun.ch/en/blog/2025/09/17/rl-weight-transfer-2): Kimi-K2,
  256 training GPUs (BF16) to 128 inference GPUs (FP8) by RDMA WRITE point to point, the
  trainer's devices quantizing their slices: 1.3 s.
- NeMo RL's checkpoint-engine refit guide (NVIDIA-NeMo/RL, docs/guides/
  checkpoint-engine-refit.md, "DeepSeek-V3 Benchmark"): 32 policy nodes (Megatron TP1,
  PP16, EP16) and 4 rollout nodes (one vLLM engine, TP32), each vLLM rank loading 69.95
  GiB of destination-local tensors: NIXL GPU RDMA 9.25 s and NCCL 14.21 s (the async
  refit timer), and the full-expert path (every rank receives the full experts) 36.812 s
  (the synchronous verifier).
- prime-rl pull request 3341 (PrimeIntellect-ai/prime-rl, "perf(nixl): pipeline reusable
  weight pulls"): GLM-5.2 (experts split over 32 inference GPUs, EP32) on 64 trainer and
  32 inference H200s, each inference GPU receiving 82.501 GB per version: the weight
  update itself 2.842 s (median at the inference client).
- NeMo RL's performance summary, v0.6 (NVIDIA-NeMo/RL, docs/about/performance-summary.md,
  "H100 BF16 Benchmarks", and the recipes of examples/configs/recipes/llm/performance/):
  the total step time of the rows whose setup no v0.4 row has: DeepSeek V3 on-policy on
  512 GPUs (111 s), Qwen3-235B-A22B on-policy on 256 (312 s), Qwen3-30B-A3B on-policy
  with generation TP 2 and training EP 8 (192 s), Qwen3-30B-A3B 8-step off on 192 GPUs
  (34.5 s; recipe grpo-qwen3-30ba3b-24n8g-async-8off: 8 nodes generate, 16 train,
  in-flight weight updates).

Assumptions, fixed before any prediction:

- the shipped hardware files unchanged (h100 for H100 and H800, h20, h200); an H800's
  NVLink 200 GB/s each way as in the development set; one 400 Gb/s NIC (50 GB/s) per GPU
  everywhere (DGX-class nodes, ConnectX-7);
- checkpoint-engine P2P: the version in the host memory of the existing instances, sent
  bucket by bucket over RDMA into a receiving GPU, then among the receiving GPUs as in the
  broadcast: the "host" path with the NIC as the link up (50 GB/s instead of PCIe), the
  receivers' broadcast over NVLink (one node) or the NIC (two); the 256-H20 rows update
  16 GPUs as the 16-H20 rows do; FP8 checkpoints served as FP8 (``native``);
- point-to-point pulls or writes (Perplexity, NeMo RL's NIXL, prime-rl's NIXL): every
  receiving GPU takes its own share at once from distinct senders, so one receiving
  GPU's share is modelled: the "direct" path with one receiver over its NIC, the share as
  the version (NeMo RL: 69.95 GiB a rank; prime-rl: 82.501 GB; Perplexity: the FP8
  model over the GPUs of one inference engine, taken as 16 (two H200 nodes: the fewest
  whole nodes that hold the 1.04 TB FP8 model with room for a KV cache), converted from
  BF16 by its share of the trainer's devices (256 / 128 = 2 a receiving GPU));
- NeMo RL's NCCL refit: the "direct" path (buckets from the trainer's devices, as the
  development set takes NeMo RL's NCCL path), every one of the 32 rollout GPUs a member
  of the broadcast over its NIC (the engine spans four nodes), the BF16 version of 671B
  parameters; the full-expert path: each rollout GPU pulls the whole BF16 version over
  its NIC (one receiver, the full version);
- no per-tensor cost (``TENSOR_S``) for any of these: each moves buckets or batches
  (NeMo RL loads its 45,395 tensors a rank in 18 batches; Perplexity replays a static
  schedule; prime-rl replays a plan; the checkpoint engine broadcasts buckets);
- NeMo RL v0.6 rows: as the development set's NeMo RL rows (``sim_published_scale``'s
  ``step_config``: log-normal responses, sigma 0.8, the row's average generated length as
  the mean, 128-token prompts, the training layout [TP, CP, EP, PP] of the table row,
  generation TP as the rollout layout, the old log-prob pass always, on-policy
  time-shared at max_staleness 0, off-policy at the row's N with the recipe's split), the
  pipeline's fill and drain now counted; 16 prompts x 32 samples for DeepSeek V3 and the
  235B, 64 x 32 for the 30B-A3B.
"""

from __future__ import annotations

from bench.simulator.published_scale_setups import (
    DEEPSEEK_V3,
    H800_NVLINK,
    NIC,
    TENSOR_S,
    Step,
    WeightSync,
)
from bench.simulator.sim_published_unseen import QWEN3_30B_A3B, QWEN3_235B_A22B

GIB = 1 << 30
NEMO_RANK_TENSORS = 45_395
"""Destination-local tensors each vLLM rank loads in NeMo RL's sharded NIXL refit (its
guide)."""
NCCL_RAILS = 2
"""Development, 2026-12-07, fitted on NeMo RL's NCCL refit (14.21 s): the NIC rails each
hop of its broadcast stripes over (NCCL's channels over a DGX node's 8 NICs)."""
KIMI_K2_ENGINE = 16
"""GPUs of one inference engine for Perplexity's Kimi-K2 (assumed: two H200 nodes)."""


def _p2p(name: str, parameters: float, bytes_per_parameter: float, hardware: str,
         devices: int, published_s: float) -> WeightSync:
    """A checkpoint-engine P2P row: host path, the NIC as the link up, ``devices``
    receivers broadcasting among themselves (NVLink within one H800 node)."""
    one_node = devices <= 8
    # Development, 2026-12-07: within one node the receiving GPUs take the version over
    # their own NICs at once, not one: the bound is the host link up, as the broadcast's.
    return WeightSync(
        name=name, framework="checkpoint-engine P2P", parameters=parameters,
        bytes_per_parameter=bytes_per_parameter, hardware=hardware, path="host",
        native=bytes_per_parameter == 1, host_bandwidth=0.0 if one_node else NIC,
        engine_devices=devices,
        receivers=devices, interconnect=H800_NVLINK if one_node else NIC,
        intra_node_bandwidth=H800_NVLINK if one_node else 0.0, published_s=published_s)


HELDOUT_SYNCS = (
    _p2p("GLM-4.5-Air BF16, 8 H800, TP8", 106e9, 2, "h100", 8, 4.12),
    _p2p("Qwen3-235B-A22B BF16, 8 H800, TP8", 235e9, 2, "h100", 8, 7.10),
    _p2p("DeepSeek-V3.1 FP8, 16 H20, TP16", 671e9, 1, "h20", 16, 11.80),
    _p2p("Kimi-K2 FP8, 16 H20, TP16", 1.04e12, 1, "h20", 16, 17.49),
    _p2p("DeepSeek-V3.1 FP8, 16 of 256 H20, TP16", 671e9, 1, "h20", 16, 11.81),
    _p2p("Kimi-K2 FP8, 16 of 256 H20, TP16", 1.04e12, 1, "h20", 16, 16.75),
    WeightSync(name="Kimi-K2, 256 BF16 trainer GPUs -> 128 FP8 inference GPUs",
               framework="Perplexity RDMA", parameters=1.04e12, bytes_per_parameter=1,
               hardware="h200", path="p2p", trainer_devices=256,
               engine_devices=KIMI_K2_ENGINE, receivers=128 // KIMI_K2_ENGINE,
               interconnect=NIC, published_s=1.3),
    WeightSync(name="DeepSeek-V3, 256 H100 (PP16 EP16) -> TP32 over 4 nodes, NIXL",
               framework="NeMo RL", parameters=69.95 * GIB / 2, bytes_per_parameter=2,
               hardware="h100", path="p2p", trainer_devices=256, engine_devices=1,
               receivers=1, interconnect=NIC, tensors=NEMO_RANK_TENSORS, tensor_s=TENSOR_S,
               published_s=9.25),
    WeightSync(name="DeepSeek-V3, 256 H100 (PP16 EP16) -> TP32 over 4 nodes, NCCL",
               framework="NeMo RL", parameters=671e9, bytes_per_parameter=2,
               hardware="h100", path="direct", trainer_devices=256, engine_devices=32,
               receivers=32, interconnect=NIC, rails=NCCL_RAILS, published_s=14.21),
    WeightSync(name="DeepSeek-V3, 256 H100 -> TP32, NIXL full experts (sync)",
               framework="NeMo RL", parameters=671e9, bytes_per_parameter=2,
               hardware="h100", path="p2p", trainer_devices=256, engine_devices=1,
               receivers=1, interconnect=NIC, published_s=36.812),
    WeightSync(name="GLM-5.2, 64 -> 32 H200 (EP32), NIXL pulls",
               framework="prime-rl", parameters=82.501e9 / 2, bytes_per_parameter=2,
               hardware="h200", path="p2p", trainer_devices=64, engine_devices=1,
               receivers=1, interconnect=NIC, published_s=2.842),
)
"""Development, 2026-12-07: the point-to-point rows (Perplexity's RDMA writes, NeMo RL's
and prime-rl's NIXL pulls) take the "p2p" path (no snapshot, no fixed pauses; the
senders are the trainer's devices); Perplexity's as the whole FP8 model into 8 engines of
16 GPUs; NeMo RL's sharded NIXL refit pays ``TENSOR_S`` for each of the 45,395 tensors a
vLLM rank loads (one side: the engine's loader); NeMo RL's NCCL refit stripes each hop
over ``NCCL_RAILS`` NICs."""


HELDOUT_STEPS = (
    Step(model=DEEPSEEK_V3, off_policy=False, gpus=512, generate_tp=32,
         train=(1, 1, 16, 16), max_length=1536, mean_response=697, prompts=16,
         published_s=111.0, seen=False, label="v0.6"),
    Step(model=QWEN3_235B_A22B, off_policy=False, gpus=256, generate_tp=16,
         train=(2, 2, 16, 8), max_length=8192, mean_response=5713, prompts=16,
         published_s=312.0, seen=False, label="v0.6"),
    Step(model=QWEN3_30B_A3B, off_policy=False, gpus=32, generate_tp=2,
         train=(1, 1, 8, 1), max_length=4096, mean_response=3203, prompts=64,
         published_s=192.0, seen=False, label="v0.6, generation TP2"),
    Step(model=QWEN3_30B_A3B, off_policy=True, gpus=192, generate_tp=2,
         train=(1, 1, 8, 1), max_length=4096, mean_response=3206, prompts=64,
         published_s=34.5, in_flight=True, seen=False, staleness=8, rollout_gpus=64,
         label="v0.6, 8-step off"),
)
