"""What a model's config.json says about its shape, as the simulator's costs need it.

Owns: ``moe_layout`` and ``mlp_parameters`` (a decoder's feed-forward layers, dense or
mixtures of experts), ``attention_parameters`` (its attention layers' weights, of each
kind below, as the models' own modules hold them), and ``AttentionState`` /
``attention_state``: the bytes an engine holds for a sequence as vLLM lays them out,
for the attention kinds config.json names:

- **full attention** (Qwen2/Llama-style, grouped queries): keys and values of every
  layer, ``2 x kv heads x head dim`` values a token (``workers.model_config``'s count);
- **multi-head latent attention** (DeepSeek V2/V3, Kimi: ``kv_lora_rank``,
  ``qk_rope_head_dim``): one compressed latent and one rotary key a token and layer,
  ``kv_lora_rank + qk_rope_head_dim`` values (vLLM's MLA cache: one "head" of that
  size); attention's FLOPs per head grow with ``(qk_nope_head_dim + qk_rope_head_dim +
  v_head_dim) / 2`` (scores at the query-key width, the weighted sum at the value width);
- **linear attention** in hybrid models, whose linear layers keep a fixed state per
  sequence instead of a cache that grows per token: Gated DeltaNet (Qwen3-Next, Qwen3.5:
  ``layer_types`` with ``"linear_attention"``, else one full-attention layer every
  ``full_attention_interval``; ``linear_num_key_heads``, ``linear_num_value_heads``,
  ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``) and
  Kimi Delta Attention (``linear_attn_config``: ``kda_layers`` or ``full_attn_layers``,
  ``num_heads``, ``head_dim``, ``short_conv_kernel_size``). A layer's state is vLLM's
  (``MambaStateShapeCalculator``): a recurrent matrix per value head (key dim x value
  dim) and a short convolution's last ``kernel - 1`` inputs of the queries, keys and
  values. Only the full-attention layers hold a per-token cache or pay attention's
  quadratic FLOPs.

Every value takes the model's dtype (vLLM's "auto" cache dtypes), but a recurrent state
config.json gives a ``mamba_ssm_dtype`` (Qwen3.5: float32). A config.json without these
keys is counted as before (every layer full attention). Knows nothing about costs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from workers.model_config import kv_bytes_per_token as full_kv_bytes

SSM_WIDTHS = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
"""Bytes of a recurrent state's value by config.json's ``mamba_ssm_dtype``."""


class AttentionState(msgspec.Struct, frozen=True, kw_only=True):
    """A model's attention as an engine holds it and a trainer computes it."""

    kv_bytes_per_token: float
    """Cache bytes one token of context takes, over the full-attention layers."""
    state_bytes_per_sequence: float = 0.0
    """Fixed bytes every running sequence holds in the linear-attention layers."""
    attention_width: float
    """Full-attention layers x query heads x attention's head width: training a sequence
    of T tokens costs 6 x this x T^2 FLOPs of causal attention."""
    full_layers: int
    linear_layers: int = 0


def layer_kinds(c: Mapping[str, Any]) -> tuple[int, int]:
    """(full-attention layers, linear-attention layers) of the decoder whose config.json is
    ``c``. A layer listed as anything but ``"linear_attention"`` (sliding, sparse) counts
    as full attention."""
    layers = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types:
        linear = sum(1 for kind in list(types)[:layers] if kind == "linear_attention")
        return layers - linear, linear
    kimi = c.get("linear_attn_config")
    if isinstance(kimi, Mapping):
        if kimi.get("kda_layers") is not None:
            linear = len(kimi["kda_layers"])
        else:
            linear = layers - len(kimi.get("full_attn_layers") or range(layers))
        linear = min(max(linear, 0), layers)
        return layers - linear, linear
    interval = c.get("full_attention_interval")
    if interval and c.get("linear_num_value_heads"):
        full = layers // int(interval)  # layer i is full when (i + 1) % interval == 0
        return full, layers - full
    return layers, 0


def linear_state_bytes(c: Mapping[str, Any], width: float) -> float:
    """Bytes one linear-attention layer keeps for one sequence (0: none named): the
    recurrent state at ``mamba_ssm_dtype`` when config.json names one (Qwen3.5:
    float32), the convolution's at ``width``."""
    recurrent_width = SSM_WIDTHS.get(str(c.get("mamba_ssm_dtype")), width)
    kimi = c.get("linear_attn_config")
    if isinstance(kimi, Mapping) and kimi.get("num_heads"):
        heads, dim = int(kimi["num_heads"]), int(kimi.get("head_dim") or 128)
        kernel = int(kimi.get("short_conv_kernel_size") or 4)
        return (heads * dim * dim * recurrent_width
                + 3 * heads * dim * (kernel - 1) * width)
    if c.get("linear_num_value_heads"):
        v_heads, k_heads = int(c["linear_num_value_heads"]), int(c["linear_num_key_heads"])
        k_dim, v_dim = int(c["linear_key_head_dim"]), int(c["linear_value_head_dim"])
        kernel = int(c.get("linear_conv_kernel_dim") or 4)
        conv = (2 * k_heads * k_dim + v_heads * v_dim) * (kernel - 1)
        return v_heads * k_dim * v_dim * recurrent_width + conv * width
    return 0.0


def attention_state(c: Mapping[str, Any], width: float) -> AttentionState:
    """The attention of the decoder whose config.json is ``c`` (a multimodal one's
    ``text_config`` already merged in), at ``width`` bytes a value."""
    full, linear = layer_kinds(c)
    layers = int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    if c.get("kv_lora_rank"):  # multi-head latent attention
        rope = int(c.get("qk_rope_head_dim") or 0)
        per_layer = (int(c["kv_lora_rank"]) + rope) * width
        qk = int(c.get("qk_nope_head_dim") or 0) + rope
        head_width = (qk + int(c.get("v_head_dim") or qk)) / 2
    else:  # every layer's keys and values (exact when all layers are full)
        per_layer = full_kv_bytes(c, width) / layers
        head_width = c.get("head_dim") or c["hidden_size"] // heads
        if not linear:
            return AttentionState(kv_bytes_per_token=full_kv_bytes(c, width),
                                  attention_width=float(layers * heads * head_width),
                                  full_layers=layers)
    return AttentionState(kv_bytes_per_token=float(full * per_layer),
                          state_bytes_per_sequence=linear * linear_state_bytes(c, width),
                          attention_width=float(full * heads * head_width),
                          full_layers=full, linear_layers=linear)


def moe_layout(c: dict[str, Any]) -> tuple[int, int]:
    """(layers with experts, experts per token) of the decoder whose config.json is ``c``:
    (0, 0) for a dense one. Layers in ``mlp_only_layers``, off ``decoder_sparse_step``
    (Qwen) or among the first ``first_k_dense_replace`` (DeepSeek) are dense."""
    layers = c["num_hidden_layers"]
    experts = routed_experts(c)
    if not experts:
        return 0, 0
    dense_only, step = set(c.get("mlp_only_layers") or ()), c.get("decoder_sparse_step") or 1
    first, every = c.get("first_k_dense_replace") or 0, c.get("moe_layer_freq") or 1
    moe = sum(1 for i in range(first, layers)
              if i not in dense_only and (i + 1) % step == 0 and i % every == 0)
    return moe, min(experts_per_token(c), experts)


def routed_experts(c: Mapping[str, Any]) -> int:
    """A MoE layer's routed experts (0: dense): ``num_experts`` (Qwen, Kimi),
    ``num_local_experts`` (Mixtral) or ``n_routed_experts`` (DeepSeek)."""
    return int(c.get("num_experts") or c.get("num_local_experts")
               or c.get("n_routed_experts") or 0)


def experts_per_token(c: Mapping[str, Any]) -> int:
    """The routed experts a token passes through (``num_experts_per_tok``, Kimi's
    ``num_experts_per_token``)."""
    return int(c.get("num_experts_per_tok") or c.get("num_experts_per_token")
               or c.get("experts_per_token") or 1)


def mlp_parameters(c: dict[str, Any]) -> tuple[int, int]:
    """The feed-forward parameters of every layer of the decoder whose config.json is
    ``c``: all of them, and those one token passes through.

    A dense layer has gate, up and down projections of ``intermediate_size``. A
    mixture-of-experts layer (``num_experts`` or ``num_local_experts`` experts, of
    ``moe_intermediate_size``, else ``intermediate_size``, each) holds its router
    (hidden x experts), every expert and the shared expert of
    ``shared_expert_intermediate_size`` with its one-output gate, if any; a token passes
    through the router, ``num_experts_per_tok`` experts and the shared one. DeepSeek's and
    Kimi's shared experts are ``n_shared_experts`` (``num_shared_experts``) experts' width
    without a gate. Layers in ``mlp_only_layers``, off the ``decoder_sparse_step`` (Qwen's
    MoE configs), among the ``first_k_dense_replace`` or off the ``moe_layer_freq``
    (DeepSeek's, Kimi's) are dense. Biases and a MoE's router biases are not counted.
    Dense: the two are equal.
    """
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    dense = 3 * hidden * c["intermediate_size"]
    experts = routed_experts(c)
    if not experts:
        return layers * dense, layers * dense
    expert_width = c.get("moe_intermediate_size") or c["intermediate_size"]
    expert = 3 * hidden * expert_width
    shared_width = c.get("shared_expert_intermediate_size") or 0
    shared = 3 * hidden * shared_width + (hidden if shared_width else 0)
    if not shared_width:  # DeepSeek, Kimi: shared experts of the routed ones' width
        shared = 3 * hidden * expert_width * int(c.get("n_shared_experts")
                                                 or c.get("num_shared_experts") or 0)
    moe_layers, routed = moe_layout(c)
    fixed = (layers - moe_layers) * dense + moe_layers * (hidden * experts + shared)
    return (fixed + moe_layers * experts * expert, fixed + moe_layers * routed * expert)


def attention_parameters(c: Mapping[str, Any]) -> int:
    """The weights of every attention layer of the decoder whose config.json is ``c``
    (its token mixers: full, latent or linear attention, as ``layer_kinds`` counts them),
    as the models' modules hold them: projections, their norms, convolutions and gates.
    Biases are counted where config.json turns them on (Qwen2's query, key and value)."""
    full, linear = layer_kinds(c)
    return full * full_attention_parameters(c) + linear * linear_attention_parameters(c)


def full_attention_parameters(c: Mapping[str, Any]) -> int:
    """One full-attention layer's weights. Grouped queries: query, key, value and output
    projections, the query doubled where an output gate rides on it (Qwen3-Next's
    ``attn_output_gate``), Qwen3's per-head query and key norms, OLMo's full-width ones.
    Latent attention (``kv_lora_rank``): the query straight or through its
    ``q_lora_rank`` latent and norm, the key-value latent with the rotary key, its norm,
    its up-projection to every head's key and value, and the output projection."""
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    bias = bool(c.get("attention_bias"))
    if c.get("kv_lora_rank"):
        latent, rope = int(c["kv_lora_rank"]), int(c.get("qk_rope_head_dim") or 0)
        qk = int(c.get("qk_nope_head_dim") or 0) + rope
        v = int(c.get("v_head_dim") or qk)
        q_rank = int(c.get("q_lora_rank") or 0)
        query = (hidden * q_rank + q_rank * (1 + bias) + q_rank * heads * qk if q_rank
                 else hidden * heads * qk)
        key_value = (hidden + bias) * (latent + rope) + latent + latent * heads * (qk - rope + v)
        return query + key_value + heads * v * hidden + bias * hidden
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    gated = bool(c.get("attn_output_gate", c.get("model_type") == "qwen3_next"))
    projected = (heads * (1 + gated) + 2 * kv_heads) * head_dim
    weights = hidden * projected + heads * head_dim * hidden
    if bias:
        weights += projected + hidden
    elif c.get("model_type") == "qwen2":  # Qwen2: query, key and value biases
        weights += (heads + 2 * kv_heads) * head_dim
    if str(c.get("model_type", "")).startswith("qwen3"):  # per-head query and key norms
        weights += 2 * head_dim
    elif c.get("model_type") in ("olmoe", "olmo2"):  # query and key norms, full width
        weights += (heads + kv_heads) * head_dim
    return weights


def linear_attention_parameters(c: Mapping[str, Any]) -> int:
    """One linear-attention layer's weights (0: none named). Gated DeltaNet (Qwen3-Next):
    the fused query-key-value-gate and beta-decay projections, the short convolution of
    queries, keys and values, per value head a decay and its bias, the gated norm and the
    output projection. Kimi Delta Attention: query, key and value projections, their
    convolutions, the per-channel forget gate's two-step projection, decay and bias, the
    per-head beta, the output gate's two-step projection, the gated norm and the output
    projection."""
    hidden = int(c["hidden_size"])
    kimi = c.get("linear_attn_config")
    if isinstance(kimi, Mapping) and kimi.get("num_heads"):
        heads, dim = int(kimi["num_heads"]), int(kimi.get("head_dim") or 128)
        kernel = int(kimi.get("short_conv_kernel_size") or 4)
        width = heads * dim
        return (3 * hidden * width + 3 * width * kernel  # q, k, v and their convolutions
                + 2 * (hidden * dim + dim * width)  # forget gate and output gate
                + width + heads + hidden * heads  # decay bias, decay, beta
                + dim + width * hidden)  # gated norm, output
    if c.get("linear_num_value_heads"):
        v_heads, k_heads = int(c["linear_num_value_heads"]), int(c["linear_num_key_heads"])
        keys = k_heads * int(c["linear_key_head_dim"])
        v_dim = int(c["linear_value_head_dim"])
        values = v_heads * v_dim
        kernel = int(c.get("linear_conv_kernel_dim") or 4)
        return (hidden * (2 * keys + 2 * values) + hidden * 2 * v_heads
                + (2 * keys + values) * kernel + 2 * v_heads + v_dim + values * hidden)
    return 0
