"""The ``[simulate]`` section: what ``async-rl simulate`` reads beside the run's config.

Owns: ``SimulateConfig`` (hardware file, length law, model size, trace detail) and
``HardwareOverrides`` (any hardware-file key, set from the config or ``--set``). The
root ``async_rl.config.Config`` holds it; the simulator (``async_rl.sim``) reads it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from buffers.common.config import Fraction, NonNegative, Positive, PositiveFloat

NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class HardwareOverrides(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                        omit_defaults=True):
    """``[simulate.hardware_overrides]``: any key of the hardware file, replacing its
    value (``--set simulate.hardware_overrides.train_mfu=0.2``); unset keys keep the
    file's. Each key means what it means in the file (docs/simulator.md, "The cost
    model")."""

    devices_per_rollout_worker: Positive | None = None
    devices_per_trainer_shard: Positive | None = None
    peak_flops: PositiveFloat | None = None
    memory_bandwidth: PositiveFloat | None = None
    interconnect_bandwidth: PositiveFloat | None = None
    train_mfu: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    moe_train_mfu: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    decode_mfu: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    memory_efficiency: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    device_memory: NonNegativeFloat | None = None
    engine_release_s: NonNegativeFloat | None = None
    engine_reload_s: NonNegativeFloat | None = None
    decode_step_s: NonNegativeFloat | None = None
    micro_batch_s: NonNegativeFloat | None = None
    update_s: NonNegativeFloat | None = None
    publish_s: NonNegativeFloat | None = None
    weight_load_s: NonNegativeFloat | None = None
    weight_member_s: NonNegativeFloat | None = None
    weight_tensor_s: NonNegativeFloat | None = None
    call_s: NonNegativeFloat | None = None
    cores: NonNegative | None = None
    engine_processes: PositiveFloat | None = None
    contention: NonNegativeFloat | None = None
    devices_per_node: Positive | None = None
    intra_node_bandwidth: NonNegativeFloat | None = None
    intra_node_latency: NonNegativeFloat | None = None
    inter_node_bandwidth: NonNegativeFloat | None = None
    nic_rails: NonNegative | None = None
    inter_node_latency: NonNegativeFloat | None = None
    host_bandwidth: NonNegativeFloat | None = None
    host_copy_bandwidth: NonNegativeFloat | None = None


class RolloutLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                    omit_defaults=True):
    """``simulate.rollout_layout``: how one rollout engine spans its devices (tensor,
    pipeline and expert parallel, as vLLM's --tensor-parallel-size, --pipeline-parallel-size
    and --enable-expert-parallel lay them out). 0: not given (1 when another key is). With
    no key given, an engine's devices (devices_per_rollout_worker) add up their FLOP/s and
    bandwidth and talk for free; with one given, the engine spans tp x pp devices and
    pays the collectives of its layout (docs/simulator.md, "The parallelism model")."""

    tp: NonNegative = 0
    pp: NonNegative = 0
    ep: NonNegative = 0
    """Devices the experts are split over (their all-to-all per MoE layer); at most tp x pp."""

    @property
    def devices(self) -> int:
        """Devices one engine spans: tp x pp (0: no key given)."""
        return (self.tp or 1) * (self.pp or 1) if self.tp or self.pp or self.ep else 0


class TrainerLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                    omit_defaults=True):
    """``simulate.trainer_layout``: how one trainer replica (a data-parallel shard) spans its
    devices, in Megatron's terms: tensor, pipeline, context and expert parallel; dp, when
    given, must be trainer.num_shards. 0: not given (1 when another key is). With no key
    given, a shard's devices (devices_per_trainer_shard) add up and talk for free; with one
    given, a shard spans tp x pp x cp devices and pays its layout's collectives."""

    tp: NonNegative = 0
    pp: NonNegative = 0
    cp: NonNegative = 0
    ep: NonNegative = 0
    """Expert-parallel size: its group's members are tp apart (Megatron's rank order), so
    it spans ep x tp devices, across replicas when that is more than one replica's."""
    dp: NonNegative = 0

    @property
    def devices(self) -> int:
        """Devices one replica spans: tp x pp x cp (0: no key given)."""
        given = self.tp or self.pp or self.cp or self.ep or self.dp
        return (self.tp or 1) * (self.pp or 1) * (self.cp or 1) if given else 0


class Architecture(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                   omit_defaults=True):
    """``simulate.architecture``: the model's shape where the collectives need it and there
    is no config.json to read it from (0: from model.path's config.json, else unknown)."""

    layers: NonNegative = 0
    """num_hidden_layers."""
    hidden_size: NonNegative = 0
    experts: NonNegative = 0
    """Routed experts of a MoE layer (num_experts, num_local_experts, n_routed_experts)."""
    experts_per_token: NonNegative = 0
    """num_experts_per_tok: the experts each token is sent to (its all-to-all's fan-out)."""
    moe_layers: NonNegative = 0
    """Layers with experts (0 with experts given: every layer)."""


WeightsPath = Literal["direct", "gathered", "host", "p2p", "stage_heads", "host_replica"]
"""How a framework moves a weight version (docs/simulator.md, "A weight version's stages")."""
LendArm = Literal["off", "starvation", "autopilot"]
"""Which rule lends trainer devices to generation while a run trains (docs/simulator.md,
"Devices lent between the roles")."""
RefitOffload = Literal["none", "optimizer", "all"]
"""What a time-shared trainer offloads while the engines generate (docs/simulator.md,
"Time-shared devices")."""
class SimulateConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``async-rl simulate`` needs besides the run's own sections: the hardware,
    the lengths and the model's size (``async-rl train`` ignores this section)."""

    hardware: str = "cpu"
    """A hardware file (TOML: devices per worker, peak FLOP/s, memory bandwidth, MFUs,
    interconnect bandwidth, fixed overheads; docs/simulator.md), or a shipped one by name:
    cpu (this project's 2-core test machine, calibrated), h100, h200, a100, h20."""
    lengths: str = "task"
    """Where completion lengths come from: "task" (the built-in task's reference
    completions: arithmetic, longtail), "lognormal" (simulate.length_median and
    length_sigma), "empirical" (drawn from simulate.length_values), "file:PATH" (drawn
    from the integers in a text file: a dataset's reference lengths, counted with its
    tokenizer), or a run directory, whose ledger's generated lengths are replayed prompt
    by prompt. All are capped at rollout.max_new_tokens."""
    length_median: PositiveFloat = 200.0
    """Median completion tokens of lengths = "lognormal"."""
    length_sigma: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """Standard deviation of log(length) of lengths = "lognormal"."""
    group_spread: Annotated[float, msgspec.Meta(ge=0)] = 0.3
    """lognormal: the part of length_sigma shared by a group's samples is the rest; this
    is the standard deviation of log(length) between samples of one prompt."""
    length_values: tuple[Annotated[int, msgspec.Meta(ge=1)], ...] = ()
    """The completion lengths lengths = "empirical" draws from."""
    prompt_tokens: NonNegative = 0
    """Tokens of every prompt; 0 = each prompt's text length in bytes (the byte-level
    tokenizer of the built-in models)."""
    hardware_overrides: HardwareOverrides = msgspec.field(default_factory=HardwareOverrides)
    """Keys of the hardware file replaced for this run (``[simulate.hardware_overrides]``
    or ``--set simulate.hardware_overrides.KEY=VALUE``): devices per rollout worker and
    per trainer shard, MFUs, bandwidths, device memory, fixed overheads."""
    parameters: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Model parameters (all of them: what the weights weigh, in memory and on the wire);
    0 = counted from model.path's config.json."""
    active_parameters: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Parameters one token passes through (a mixture of experts': the shared ones and
    the experts routed to): what training and decode FLOPs count; 0 = counted from
    model.path's config.json with simulate.parameters (its experts, experts per token
    and shared expert), else all of them (simulate.parameters). Expert parallelism is
    not modelled: an engine or a trainer shard holds every expert."""
    kv_bytes_per_token: NonNegative = 0
    """KV-cache bytes one token of context holds (2 x layers x kv heads x head dim x
    bytes; latent attention: layers x (kv_lora_rank + qk_rope_head_dim) x bytes; a
    hybrid's full-attention layers only); 0 = from model.path's config.json."""
    state_bytes_per_sequence: NonNegativeFloat = 0.0
    """Fixed bytes every running sequence holds in a hybrid model's linear-attention
    layers (Gated DeltaNet, Kimi Delta Attention: their recurrent and convolution
    states), read every decode step and reserved in the KV cache; 0 = from
    model.path's config.json (none without linear-attention layers)."""
    attention_width: NonNegative = 0
    """Layers x query heads x head dim: training a sequence of T tokens costs 6 x this x
    T^2 FLOPs of causal attention besides 6 x parameters x T; 0 = from model.path's
    config.json, or not counted when it has none."""
    lora_parameters_per_rank: NonNegativeFloat = 0.0
    """With model.lora.rank > 0: the adapters' parameters per unit of rank (the in + out
    features summed over every linear layer model.lora.target_modules names); a version
    then carries rank x this many parameters, and the shards all-reduce their gradients
    alone; 0 = counted from model.path's config.json."""
    reward_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Reward (or tool) latency of a group after its last sample; the engine goes on
    generating meanwhile."""
    reward_p: Fraction = 0.5
    """Chance that a sample scores 1. Learning is not simulated: held-out accuracy stays
    at this value."""
    weights_path: WeightsPath = "direct"
    """Which stages a weight version passes through: "direct" (buckets streamed from the
    trainer's devices: a snapshot in device memory, the broadcast, the engines' load:
    slime's and NeMo RL's NCCL path, this project's), "gathered" (the whole state
    gathered onto one rank over the trainer's links, converted, staged in host memory,
    then sent: verl's FSDP state dict) or "host" (the version in host memory, each bucket
    copied up to a device and broadcast, the two pipelined: Moonshot's checkpoint
    engine) or "p2p" (every device of every engine pulls its shard from the trainer's
    devices at once over RDMA, with no snapshot and no fixed pauses: NIXL, Perplexity's
    RDMA writes) or "stage_heads" (each pipeline stage's weights all-gathered onto its
    head rank and broadcast to every engine device, the stages in turn: a Megatron
    trainer's NCCL path, miles', slime's) or "host_replica" (each stage gathered as
    there, the stages at once, every trainer rank copying its targets' parts into a
    replica of their shard in host memory and writing them over RDMA: miles' P2P
    mode)."""
    weights_rails: Positive = 1
    """NIC rails one device's share of a weight version stripes over across nodes (NCCL's
    channels over several NICs, a NIXL pull over several): at most the hardware's
    nic_rails, shared by the node's devices that move bytes at once; 1: one NIC."""
    version_bytes_per_parameter: NonNegativeFloat = 0.0
    """Bytes a parameter takes in a weight version (1: FP8); 0: model.dtype's. Converting
    into it is a stage of its own."""
    version_native: bool = False
    """The trainer holds the version at its bytes per parameter already (an FP8 checkpoint
    served as FP8): no conversion stage."""
    version_tensors: NonNegative = 0
    """Tensors a version carries, each paying the hardware's weight_tensor_s where the
    framework moves them one by one; 0: counted from the model's layers and experts
    (``async_rl.sim.version_stages.version_tensors``)."""
    version_fraction: Fraction = 1.0
    """Share of the trained parameters a version carries (a delta or sparse version: the
    changed ones and their indices); 1: every parameter."""
    rollout_layout: RolloutLayout = msgspec.field(default_factory=RolloutLayout)
    """An engine's tp, pp, ep (``RolloutLayout``); none given: no collectives."""
    trainer_layout: TrainerLayout = msgspec.field(default_factory=TrainerLayout)
    """A trainer replica's tp, pp, cp, ep, dp (``TrainerLayout``); none given: no
    collectives."""
    architecture: Architecture = msgspec.field(default_factory=Architecture)
    """Layers, hidden size and experts where there is no config.json (``Architecture``)."""
    recompute: Literal["none", "full"] = "none"
    """Activation recompute in training: "full" runs every layer's forward twice (8 FLOPs
    per parameter and token instead of 6, and the forward's collectives again)."""
    old_logprob_pass: Literal["trainer", "always", "never"] = "trainer"
    """The forward pass over a step's samples under the policy that generated them before
    its update (the proximal, or verl's and NeMo RL's old log-prob pass): "trainer" as the
    real trainer makes it (several updates a step, trainer.tis_cap > 0), "always" (verl,
    NeMo RL), "never"."""
    refit_offload: RefitOffload = "optimizer"
    """run.colocate = "time": what the trainer moves to host memory while the engines
    generate, and back before its step: "optimizer" (its state: Adam's moments and fp32
    master weights), "all" (those and its weights: NeMo RL's and slime's offload), or
    "none". Not counted when hardware gives engine_release_s / engine_reload_s."""
    optimizer_bytes_per_parameter: NonNegativeFloat = 12.0
    """Bytes of optimizer state per trained parameter (Adam in mixed precision: two fp32
    moments and an fp32 master copy, 12); what refit_offload = "optimizer" moves."""
    sleep_level: Literal[1, 2] = 2
    """run.colocate = "time": vLLM's sleep level of a releasing engine: 2 discards its
    weights (the new version replaces them), 1 offloads them to host memory and brings
    them back on waking (its devices' share over the host link each way)."""
    lend: LendArm = "off"
    """Trainer devices serving as extra rollout engines while the run trains: "off";
    "starvation" (verl's separate_async switch: after a step whose trainer waited for its
    groups at least simulate.lend_wait of the step, while the queue holds less than the
    next step, the trainer's devices generate until the next step's groups are in hand,
    then go back); "autopilot" (the autopilot's engine count, rollout.num_workers up to
    rollout.num_workers + simulate.lend_engines, each added engine taken from the
    trainer, which trains on what is left; needs autopilot.enabled). Each switch costs a
    colocated refit's reload (lent) or release (returned) of the devices moved."""
    lend_engines: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """Engines (of devices_per_rollout_worker devices each) the lent trainer devices make
    at most; -1: as many as the trainer's devices hold ("autopilot": leaving it one
    replica's, devices_per_trainer_shard)."""
    spare_devices: NonNegative = 0
    """lend = "autopilot": devices in neither role at the start, from which the autopilot's
    added engines come instead of the trainer's (each starts by receiving the version
    over the weight path and loading it; the trainer keeps all its devices)."""
    lend_wait: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    """lend = "starvation": the least share of a step's time (from the previous step's
    end to this one's start) the trainer must have waited for its groups to lend."""
    preemption_step: NonNegative = 0
    """At the end of this step (the instant a checkpoint would be taken), count what a
    clean stop there would cost (sim.json's ``stop``, a line of the result): the replay
    queue's groups the checkpoint keeps (and how many would be too stale to train at its
    version on resume), the in-flight rollouts it hands back (continued from their
    tokens on resume; a multi-turn task's restart, lost), the tokens it loses (generated
    again from scratch), and each engine's tokens of the prompts owed (what that
    engine's death there loses). The simulated run goes on unchanged; 0 = off. At most
    run.num_steps."""
    detail: Positive = 16
    """Rollout engines the trace (trace.json) shows one by one when there are more:
    this many evenly spaced ranks, plus the most idle few; every trainer shard is kept,
    and idle.json and the idle table account for every device. Past 16 devices the
    timeline draws one row per role and the most idle devices. (Read by the report of
    any run directory, real or simulated.)"""
