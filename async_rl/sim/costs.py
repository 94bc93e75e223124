"""The simulator's cost model: a hardware file's few physical parameters, and the seconds
each piece of work takes on it.

Owns: ``Hardware`` (one TOML file: devices per worker, peak FLOP/s, memory bandwidth,
MFUs, interconnect bandwidth, fixed overheads; the shipped ones are in
``async_rl/sim/hardware/``), the model's size as the costs need it (``ModelShape``: from
model.path's config.json, a mixture of experts' total and active parameters counted from
its experts, or the simulate section), and ``Costs``, which turns them into
seconds:

- a decode step of ``n`` running sequences holding ``context`` tokens: a fixed overhead
  plus the larger of the compute (2·N FLOPs per sequence at the decode MFU, N the
  active parameters) and the memory traffic (all the weights once, plus every context
  token's KV entries, at the achieved bandwidth); a prefill of ``tokens`` is
  compute-bound;
- a training micro-batch of sequences of T tokens each: 6·N·T (N active) plus
  6·W·T² for causal attention (W: layers x query heads x head dim; forward 2·W·T²,
  backward twice that) at the training MFU, plus a fixed overhead, slower while rollout
  engines are busy on the same machine (``cores``, ``contention``: CPU machines only);
  a mixture of experts trains at ``moe_train_mfu`` where the hardware gives it;
  an optimizer update: a fixed overhead plus the gradient all-reduce between shards
  (ring: 2·(S-1)/S of the gradient's bytes, each of a shard's devices sending its own
  slice over its own link);
- a weight version: its snapshot (bytes at the memory bandwidth, plus a fixed part) and
  its delivery (bytes over the interconnect, plus a fixed engine pause); shard 0 sends
  to every engine at once over one pair group each, so the sends share its link. With
  LoRA (model.lora.rank > 0) a version, and the gradients all-reduced, are the adapters'
  (``adapter_parameters``) alone;
- time-shared devices (run.colocate = "time"): an engine's release and reload, derived
  from the bytes offloaded, resharded and copied (``async_rl.sim.refit``) unless the
  hardware gives them;
- the PPO roles beside a trainer shard (placement "trainer", on its devices): a forward
  pass (the frozen reference's logprobs, the critic's values) costs a third of a
  micro-batch's forward and backward, the critic's update a micro-batch's forward and
  backward and an optimizer update of its own (``forward_pass``; the critic has the
  policy's shape).

Knows nothing about the orchestrator or the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import msgspec

from async_rl.sim.architecture import (
    attention_parameters,
    attention_state,
    mlp_parameters,
    moe_layout,
    routed_experts,
)
from async_rl.sim.hardware_file import Hardware
from async_rl.sim.parallel import Collectives, Dims, Layout, Links
from async_rl.sim.refit import RefitStages, refit_stages
from async_rl.sim.version_stages import VersionPath, VersionStages, version_tensors
from buffers.common.config import ConfigError
from workers.model_config import LoraConfig, lora_features

FORWARD_SHARE = 1 / 3
"""A forward pass alone over a forward and backward: 2 of the 6 FLOPs per parameter and
token (``Costs.forward_pass``)."""


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    """What the costs need of the model."""

    parameters: float
    """All of them: the weights' bytes (read every decode step, sent every version, in
    memory), the gradients' (all-reduced every update)."""
    active_parameters: float = 0.0
    """Those one token passes through (a mixture of experts': shared and routed-to
    experts): the FLOPs of training, decode and prefill; 0: all of them."""
    kv_bytes_per_token: float
    state_bytes_per_sequence: float = 0.0
    """Fixed bytes each running sequence holds beside its KV cache (linear-attention
    layers' state: ``async_rl.sim.attention_state``)."""
    bytes_per_parameter: float
    """Of the weights as rollout and training hold them (model.dtype)."""
    attention_width: float = 0.0
    """Layers x query heads x head dim: what attention's FLOPs grow with (0: not
    counted)."""
    adapter_parameters: float = 0.0
    """With LoRA, the adapters' parameters: all a weight version carries and all the
    gradients the shards all-reduce (0: no LoRA, the whole model's)."""
    layers: int = 0
    hidden: int = 0
    moe_layers: int = 0
    """Layers with experts (their all-to-alls under expert parallelism)."""
    experts_per_token: int = 0
    """Experts each token is routed to (0: a dense model)."""
    tensors: int = 0
    """Tensors of the state dict a weight version carries (0: unknown, none counted)."""


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """How the run lays the model out and moves its versions (simulate's keys); the
    default is the simulator's behaviour without them."""

    rollout: Layout = Layout()
    trainer: Layout = Layout()
    shards: int = 1
    """Trainer replicas (trainer.num_shards)."""
    weights_path: str = "direct"
    weights_rails: int = 1
    """NIC rails one device's share of a version stripes over (simulate.weights_rails)."""
    version_bytes_per_parameter: float = 0.0
    """0: the model's (bytes_per_parameter)."""
    version_fraction: float = 1.0
    version_native: bool = False
    """The version's dtype is the trainer's already: no conversion."""
    recompute: bool = False
    refit_offload: str = "optimizer"  # time-shared devices: async_rl.sim.refit
    optimizer_bytes_per_parameter: float = 12.0
    sleep_level: int = 2


def model_shape(model_path: str, dtype: str, *, parameters: float = 0.0,
                kv_bytes_per_token: float = 0.0, attention_width: float = 0.0,
                active_parameters: float = 0.0, state_bytes_per_sequence: float = 0.0
                ) -> ModelShape:
    """The model's size: given figures win, the rest is counted from its config.json (a
    Qwen2/Llama-style decoder, its feed-forward layers dense or mixtures of experts:
    ``mlp_parameters``). A mixture of experts' active parameters are counted with its
    parameters, when neither is given. With parameters and kv_bytes_per_token given and
    no config.json, attention is counted only if ``attention_width`` is given. The KV
    bytes, a sequence's fixed state and attention's width follow the attention kind
    config.json names (``async_rl.sim.attention_state``: full, latent or linear)."""
    width = 2.0 if dtype in ("bfloat16", "float16", "auto") else 4.0
    path = Path(model_path) / "config.json"
    if parameters and kv_bytes_per_token and (attention_width or not path.is_file()):
        return ModelShape(parameters=parameters, kv_bytes_per_token=kv_bytes_per_token,
                          bytes_per_parameter=width, attention_width=attention_width,
                          active_parameters=active_parameters,
                          state_bytes_per_sequence=state_bytes_per_sequence)
    if not path.is_file():
        raise ConfigError(f"config error: simulate.parameters = {parameters:g}: model.path "
                          f"{model_path!r} has no config.json to count them from: give "
                          "simulate.parameters and simulate.kv_bytes_per_token")
    c = json.loads(path.read_text())
    c = {**c, **c.get("text_config", {})}  # a multimodal config: its language model's
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    kind = attention_state(c, width)
    mlp, active_mlp = mlp_parameters(c)
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    rest = attention_parameters(c) + layers * 2 * hidden + embeddings + hidden
    if not active_parameters and not parameters and active_mlp < mlp:  # counted: a MoE's
        active_parameters = float(rest + active_mlp)
    moe_layers, routed = moe_layout(c)
    return ModelShape(parameters=parameters or float(rest + mlp),
                      active_parameters=active_parameters,
                      kv_bytes_per_token=kv_bytes_per_token or kind.kv_bytes_per_token,
                      state_bytes_per_sequence=(state_bytes_per_sequence
                                                or kind.state_bytes_per_sequence),
                      bytes_per_parameter=width,
                      attention_width=attention_width or kind.attention_width,
                      layers=layers, hidden=hidden, moe_layers=moe_layers,
                      experts_per_token=routed,
                      tensors=version_tensors(layers=layers, moe_layers=moe_layers,
                                              experts=routed_experts(c)))


def adapter_parameters(model_path: str, lora: LoraConfig, per_rank: float = 0.0) -> float:
    """Parameters of ``lora``'s adapters on the model at ``model_path``: rank x
    ``per_rank`` when given (simulate.lora_parameters_per_rank), else rank x the in + out
    features of the target modules, counted from its config.json
    (``workers.model_config.lora_features``)."""
    if per_rank:
        return lora.rank * per_rank
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ConfigError(f"config error: model.lora.rank = {lora.rank}: model.path "
                          f"{model_path!r} has no config.json to count the adapters from: "
                          "give simulate.lora_parameters_per_rank")
    features = lora_features(json.loads(path.read_text()))
    missing = [name for name in lora.target_modules if name not in features]
    if missing:
        raise ConfigError(f"config error: model.lora.target_modules = "
                          f"{list(lora.target_modules)}: {missing} not among the linear "
                          f"layers the simulator counts ({sorted(features)}): give "
                          "simulate.lora_parameters_per_rank")
    return float(lora.rank * sum(features[name] for name in lora.target_modules))


class Costs:
    """Seconds of each piece of work of ``model`` on ``hardware``."""

    def __init__(self, hardware: Hardware, model: ModelShape, plan: Plan | None = None
                 ) -> None:
        self.hardware, self.model = hardware, model
        self.plan = plan = plan or Plan()
        h = hardware
        # FLOPs count the parameters a token passes through; bytes count all of them.
        n = model.active_parameters or model.parameters
        rollout, trainer = h.devices_per_rollout_worker, h.devices_per_trainer_shard
        self.weight_bytes = model.parameters * model.bytes_per_parameter
        self.trained_parameters = model.adapter_parameters or model.parameters
        """What the optimizer updates and the shards all-reduce: with LoRA, the adapters."""
        self.version_bytes = self.trained_parameters * plan.version_fraction * (
            plan.version_bytes_per_parameter or model.bytes_per_parameter)
        calls = 0 if model.adapter_parameters else model.tensors  # LoRA: a few adapters
        """What a weight version carries: with LoRA, the adapters alone; a delta's share,
        at the version's bytes per parameter."""
        self._decode_flop_s = 2 * n / (h.peak_flops * rollout * h.decode_mfu)
        """Seconds of compute per sequence per decode step (and per prefill token)."""
        bandwidth = h.memory_bandwidth * rollout * h.memory_efficiency
        self._weights_read_s = self.weight_bytes / bandwidth
        self._kv_read_s = model.kv_bytes_per_token / bandwidth
        self._state_read_s = model.state_bytes_per_sequence / bandwidth
        """Seconds of reading one running sequence's fixed state (linear attention)."""
        self.state_tokens = (model.state_bytes_per_sequence / model.kv_bytes_per_token
                             if model.kv_bytes_per_token else 0.0)
        """A sequence's fixed state in KV-cache tokens (what it reserves besides its own)."""
        flops = 8 if plan.recompute else 6  # a second forward with recompute
        self._forward_share = 2 / flops
        moe = model.experts_per_token > 0 or 0 < model.active_parameters < model.parameters
        mfu = h.moe_train_mfu if moe and h.moe_train_mfu else h.train_mfu
        train_flop_s = 1 / (h.peak_flops * trainer * mfu)
        self._train_token_s = flops * n * train_flop_s
        self._train_square_s = flops * model.attention_width * train_flop_s
        """Seconds of causal attention per squared token of a sequence."""
        links = Links(per_node=h.devices_per_node,
                      intra_bandwidth=h.intra_node_bandwidth or h.interconnect_bandwidth,
                      intra_latency=h.intra_node_latency,
                      inter_bandwidth=h.inter_node_bandwidth or h.interconnect_bandwidth,
                      inter_latency=h.inter_node_latency)
        self.collectives = Collectives(
            Dims(layers=model.layers, hidden=model.hidden, moe_layers=model.moe_layers,
                 experts_per_token=model.experts_per_token,
                 kv_bytes_per_token=model.kv_bytes_per_token,
                 activation_bytes=model.bytes_per_parameter),
            links, plan.rollout, plan.trainer, recompute=plan.recompute)
        t = plan.trainer
        holders = (t.tp * t.pp * t.ep if t.given else trainer * plan.shards)
        self.version_path = VersionPath(
            plan.weights_path, state_bytes=self.trained_parameters * (
                (plan.version_bytes_per_parameter or model.bytes_per_parameter)
                if plan.version_native else model.bytes_per_parameter),
            version_bytes=self.version_bytes, holders=min(holders, trainer * plan.shards),
            engine_devices=rollout, trainer_devices=trainer * plan.shards, links=links,
            memory_bandwidth=h.memory_bandwidth * h.memory_efficiency,
            host_bandwidth=h.host_bandwidth or h.memory_bandwidth * h.memory_efficiency,
            interconnect=h.interconnect_bandwidth, publish_s=h.publish_s,
            load_s=h.weight_load_s, member_s=h.weight_member_s, native=plan.version_native,
            tensors=calls, tensor_s=h.weight_tensor_s, rails=plan.weights_rails,
            nic_rails=h.nic_rails, pipeline_stages=t.pp,
            host_copy_bandwidth=h.host_copy_bandwidth)
        """A version's stages (simulate.weights_path)."""
        self.refit: RefitStages = refit_stages(
            weight_bytes=self.weight_bytes,
            trained_bytes=self.trained_parameters * model.bytes_per_parameter,
            version_bytes=self.version_bytes,
            optimizer_bytes=self.trained_parameters * plan.optimizer_bytes_per_parameter,
            offload=plan.refit_offload, sleep_level=plan.sleep_level,
            trainer_devices=trainer * plan.shards, holders=self.version_path.holders,
            engine_devices=rollout, host_bandwidth=self.version_path.host_bandwidth,
            memory_bandwidth=h.memory_bandwidth * h.memory_efficiency, links=links,
            release_s=h.engine_release_s, reload_s=h.engine_reload_s,
            calls_s=calls * h.weight_tensor_s)
        """A time-shared turn's parts (run.colocate = "time")."""

    def decode_step(self, running: int, context: float) -> float:
        """One engine step of ``running`` sequences holding ``context`` tokens in all."""
        compute = self._decode_flop_s * running
        memory = (self._weights_read_s + self._kv_read_s * context
                  + self._state_read_s * running)
        c = self.collectives
        return (self.hardware.decode_step_s + max(compute, memory) + c.decode_fixed_s
                + c.decode_token_s * running)

    def decode_steps(self, steps: int, running: int, context: float) -> float:
        """``steps`` steps of ``running`` sequences from ``context`` tokens (each step adds
        ``running``): the sum of ``decode_step``, in closed form."""
        if steps <= 0:
            return 0.0
        a = self._decode_flop_s * running  # compute: the same every step
        b = (self._weights_read_s + self._kv_read_s * context  # memory at step 0 ...
             + self._state_read_s * running)
        c = self._kv_read_s * running  # ... grows by c a step
        # Steps before the memory term overtakes compute run at a; the rest at b + c*s.
        first = steps if c <= 0 and b < a else max(0, min(steps, _ceil_div(a - b, c)))
        memory = (steps - first) * b + c * (steps * (steps - 1) - first * (first - 1)) / 2
        talk = self.collectives.decode_fixed_s + self.collectives.decode_token_s * running
        return steps * (self.hardware.decode_step_s + talk) + first * a + memory

    def prefill(self, tokens: int) -> float:
        c = self.collectives
        return (self._decode_flop_s + c.decode_token_s) * tokens + (
            c.decode_fixed_s if tokens else 0.0)

    def micro_batch(self, lengths: Sequence[int]) -> float:
        """Forward and backward of a micro-batch of sequences of ``lengths`` tokens."""
        c = self.collectives
        return (self.hardware.micro_batch_s + c.train_fixed_s
                + (self._train_token_s + c.train_token_s) * sum(lengths)
                + self._train_square_s * sum(t * t for t in lengths))

    def pipeline_bubble(self, micro_batches: int) -> float:
        """How many times longer a trainer replica's ``micro_batches`` take through a
        pipeline of pp stages than their work alone: the first fills and the last drains
        the pipeline, ``(m + pp - 1) / m`` (the bubble's share of the whole is
        ``(pp - 1) / (m + pp - 1)``, 1F1B's); 1 without a given layout or with pp 1."""
        pp = self.plan.trainer.pp if self.plan.trainer.given else 1
        if pp <= 1 or micro_batches <= 0:
            return 1.0
        return (micro_batches + pp - 1) / micro_batches

    def forward_pass(self, lengths: Sequence[int]) -> float:
        """A forward pass alone (no gradient) over a micro-batch of ``lengths``: a third of
        ``micro_batch`` (2 of its 6 FLOPs per parameter and token, and of its fixed
        part), as the proximal pass is counted. The reference's logprobs and the
        critic's values are such a pass of a model of the policy's shape."""
        return self.micro_batch(lengths) * self._forward_share

    def attention_share(self, lengths: Sequence[int]) -> float:
        """Attention's FLOPs over the weights' in training sequences of ``lengths``."""
        return self._train_square_s * sum(t * t for t in lengths) / max(
            self._train_token_s * sum(lengths), 1e-30)

    def train_slowdown(self, sharing: float, beside: float) -> float:
        """How many times longer a trainer shard's compute takes while ``sharing`` busy
        engines run on its own cores (they take turns, each with ``engine_processes``
        shares of a core) and ``beside`` on other cores (fractions: engines busy part of
        the time)."""
        h = self.hardware
        return (1 + h.engine_processes * sharing) * (1 + h.contention * beside)

    def engine_slowdown(self, shards: int) -> float:
        """How many times longer an engine's steps take while ``shards`` busy trainer
        shards share its cores."""
        return 1 + shards / self.hardware.engine_processes

    def update(self, shards: int, parameters: float | None = None) -> float:
        """An optimizer update's fixed part, with the all-reduce of fp32 gradients between
        ``shards`` (of ``parameters``; default the policy's trained ones: with LoRA, the
        adapters). A shard's devices hold a slice each (sharded or tensor-parallel
        weights), so each reduces its slice over its own link: the ring's bytes divide by
        ``devices_per_trainer_shard``."""
        h = self.hardware
        trained = self.trained_parameters if parameters is None else parameters
        ring = 2 * (shards - 1) / shards * trained * 4 if shards > 1 else 0.0
        return h.update_s + ring / (h.interconnect_bandwidth * h.devices_per_trainer_shard)

    def kv_tokens(self, memory_fraction: float) -> float | None:
        """Tokens of KV cache one engine holds: its devices' memory times
        ``memory_fraction`` (vLLM's gpu_memory_utilization), less the weights, over the
        KV bytes a token takes (None: the hardware gives no device_memory)."""
        h = self.hardware
        if not h.device_memory:
            return None
        room = h.device_memory * h.devices_per_rollout_worker * memory_fraction
        if room <= self.weight_bytes:
            raise ConfigError(
                f"config error: rollout.memory_fraction = {memory_fraction}: "
                f"{room / 1e9:.1f} GB of an engine's {h.devices_per_rollout_worker} "
                f"device(s) leave no room for a KV cache beside "
                f"{self.weight_bytes / 1e9:.1f} GB of weights")
        return (room - self.weight_bytes) / self.model.kv_bytes_per_token

    def release(self) -> float:
        """run.colocate = "time": an engine frees its devices for a training step."""
        return self.refit.release_s

    def reload(self) -> float:
        """run.colocate = "time": an engine takes its devices back after the step and
        copies the new version (with LoRA, the adapters) within them."""
        return self.refit.reload_s

    def publish(self) -> float:
        """The trainer's part of a version: its gather, conversion and staging."""
        return self.version_path.stages(1, 0.0).trainer_s

    def transfer(self, receivers: int = 1, bucket_bytes: float = 16 << 20) -> float:
        """Seconds of a version's broadcast to ``receivers`` engines in ``bucket_bytes``
        buckets: a pipelined chain (``workers.weights.bucket_transfer``; NCCL's ring
        broadcast pipelines the same way), where every link carries the weights once and
        the last engine holds the last bucket ``receivers - 1`` bucket times after the
        first: ``(S + (N - 1) B) / bandwidth + N m`` (docs/simulator.md)."""
        return self.version_path.transfer(receivers, bucket_bytes)

    def load(self) -> float:
        """An engine's pause for a version beyond the wire."""
        return self.version_path.load()

    def version_stages(self, receivers: int, bucket_bytes: float) -> VersionStages:
        return self.version_path.stages(receivers, bucket_bytes)


def _ceil_div(num: float, den: float) -> int:
    return int(-(-num // den)) if den > 0 else 0
