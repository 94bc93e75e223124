"""Tiny random models of every Hugging Face architecture the model matrix checks.

Owns: ``ARCHITECTURES`` (the families, by the name a user would give them), each one's
tiny config (``tiny_config``: built offline from the transformers config class, small
enough for the unit tier, with the family's distinctive feature switched on so the
matrix tests it) and ``build_family_model``, which saves a random fp32 model and the
byte tokenizer of ``async_rl.models.tiny_model`` beside it, so ``AutoTokenizer``,
``AutoModelForCausalLM`` and vLLM load it by path. Nothing is downloaded, nothing is
trained: the weights are the config class's own random initialisation from ``seed``.

Shapes shared by every family: head_dim 32 (vLLM's CPU attention needs >= 32), 4
query heads over 2 key/value heads (grouped-query) where the family has them, hidden
128, 2 decoder layers, the byte tokenizer's vocabulary. Families with a sliding window
get one of ``SLIDING_WINDOW`` tokens, which binds on test sequences of a few dozen;
hybrid families get one linear-attention and one full-attention layer; mixture-of-
experts families get ``NUM_EXPERTS`` small experts, ``EXPERTS_PER_TOKEN`` per token.

Two architectures are built as their text-only model: ``gemma3`` as ``gemma3_text``
(``Gemma3ForCausalLM``) and ``qwen3_5``/``qwen3_5_moe`` as ``qwen3_5_text``/
``qwen3_5_moe_text``; their config.json says so in ``model_type`` (``MODEL_TYPES``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
)

from async_rl.models.tiny_model import EOS_ID, PAD_ID, VOCAB_SIZE, build_tokenizer

ARCHITECTURES: Final = (
    "llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "olmoe", "mistral", "gemma2",
    "gemma3", "granite", "granitemoe", "cohere", "phi3", "olmo2", "smollm3", "gpt_oss",
    "qwen3_next", "qwen3_5", "qwen3_5_moe",
)
"""Every family the matrix checks, by architecture name."""
MODEL_TYPES: Final = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text",
                      "qwen3_5_moe": "qwen3_5_moe_text"}
"""The ``model_type`` (config.json) of the architectures built as their text-only
model; every other architecture's ``model_type`` is its own name."""

HEAD_DIM: Final = 32
HEADS: Final = 4
KV_HEADS: Final = 2
HIDDEN: Final = HEADS * HEAD_DIM
LAYERS: Final = 2
INTERMEDIATE: Final = 256
MAX_POSITIONS: Final = 512
"""Long enough for every built-in task's sequences (the longtail task's 512)."""
SLIDING_WINDOW: Final = 8
NUM_EXPERTS: Final = 4
EXPERTS_PER_TOKEN: Final = 2
EXPERT_INTERMEDIATE: Final = 64

_SHARED: Final[dict[str, Any]] = {
    "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "max_position_embeddings": MAX_POSITIONS,
    "bos_token_id": None, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
}
"""Keywords every family's config class takes."""
_HEAD_DIM: Final = {"head_dim": HEAD_DIM}
_SLIDING: Final = ["sliding_attention", "full_attention"]
_HYBRID: Final = ["linear_attention", "full_attention"]
_LINEAR_ATTENTION: Final[dict[str, Any]] = {
    "layer_types": _HYBRID, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM,
    "linear_conv_kernel_dim": 4, **_HEAD_DIM,
}
"""Hybrid families: a gated-delta-net layer, then a full-attention layer."""
_QWEN_MOE: Final[dict[str, Any]] = {
    "num_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
    "moe_intermediate_size": EXPERT_INTERMEDIATE, "norm_topk_prob": True,
}
_LOCAL_EXPERTS: Final[dict[str, Any]] = {
    "num_local_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
    "intermediate_size": EXPERT_INTERMEDIATE,
}
"""Mixtral-style MoE families, whose ``intermediate_size`` is one expert's."""
_GRANITE: Final[dict[str, Any]] = {
    "logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
    "attention_multiplier": 0.125,
}
"""Granite's multipliers, none of them 1 (the head divides its logits by 4)."""

FAMILY_KEYWORDS: Final[dict[str, dict[str, Any]]] = {
    "llama": _HEAD_DIM,
    "qwen2": {},
    "qwen3": _HEAD_DIM,  # q/k norm: always on in Qwen3
    "qwen3_moe": {**_HEAD_DIM, **_QWEN_MOE},
    "mixtral": {**_HEAD_DIM, **_LOCAL_EXPERTS},
    "olmoe": {"num_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
              "intermediate_size": EXPERT_INTERMEDIATE},
    "mistral": {**_HEAD_DIM, "sliding_window": SLIDING_WINDOW},
    "gemma2": {**_HEAD_DIM, "layer_types": _SLIDING, "sliding_window": SLIDING_WINDOW,
               "query_pre_attn_scalar": 2 * HEAD_DIM, "final_logit_softcapping": 1.0,
               "attn_logit_softcapping": 0.2},
    "gemma3": {**_HEAD_DIM, "layer_types": _SLIDING, "sliding_window": SLIDING_WINDOW,
               "query_pre_attn_scalar": 2 * HEAD_DIM},
    "granite": _GRANITE,
    "granitemoe": {**_GRANITE, **_LOCAL_EXPERTS},
    "cohere": {"logit_scale": 0.25},
    "phi3": {},
    "olmo2": {},
    "smollm3": {"no_rope_layer_interval": 2},  # the second layer has no RoPE
    "gpt_oss": {**_HEAD_DIM, **_LOCAL_EXPERTS, "layer_types": _SLIDING,
                "sliding_window": SLIDING_WINDOW,
                "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False,
                                    "original_max_position_embeddings": 64,
                                    "rope_theta": 150000.0}},
    "qwen3_next": {**_LINEAR_ATTENTION, **_QWEN_MOE,
                   "shared_expert_intermediate_size": EXPERT_INTERMEDIATE},
    "qwen3_5": _LINEAR_ATTENTION,
    "qwen3_5_moe": {**_LINEAR_ATTENTION, **_QWEN_MOE,
                    "shared_expert_intermediate_size": EXPERT_INTERMEDIATE},
}
"""Each family's keywords beside ``_SHARED``: its shape, and its distinctive feature
switched on where the default leaves it off or too weak to show on a random model
(gemma2's soft-capping, 1.0 on the logits and 0.2 on the attention scores, binds on a
random model's small values: without it the log-probs move by 0.24 and 0.003)."""


FEATURES: Final = {
    "llama": "the plain decoder: RoPE, SwiGLU, grouped-query attention",
    "qwen2": "q/k/v biases",
    "qwen3": "per-head q/k RMSNorm",
    "qwen3_moe": "mixture of experts (4, top 2, normalised), per-head q/k norm",
    "mixtral": "mixture of experts (4, top 2)",
    "olmoe": "mixture of experts (4, top 2), q/k norm over all heads",
    "mistral": f"sliding window ({SLIDING_WINDOW}) on every layer",
    "gemma2": f"logit soft-capping (1.0), attention soft-capping (0.2), sliding window "
              f"({SLIDING_WINDOW}) on alternate layers, query_pre_attn_scalar, tied head",
    "gemma3": f"sliding window ({SLIDING_WINDOW}) on alternate layers, q/k norm, "
              "query_pre_attn_scalar, tied head",
    "granite": "logits_scaling 4 (the head divides by it), embedding, residual and "
               "attention multipliers",
    "granitemoe": "granite's multipliers and logits_scaling, mixture of experts (4, top 2)",
    "cohere": "logit_scale 0.25 (the head multiplies by it), parallel attention and MLP, "
              "LayerNorm, tied head",
    "phi3": "fused qkv_proj and gate_up_proj",
    "olmo2": "q/k norm over all heads, norms after attention and MLP",
    "smollm3": "a layer without RoPE (NoPE), tied head",
    "gpt_oss": f"attention sinks, sliding window ({SLIDING_WINDOW}) on alternate layers, "
               "mixture of experts (4, top 2) with biases, YaRN RoPE",
    "qwen3_next": "hybrid: a gated-delta-net (linear attention) layer and a gated "
                  "full-attention layer; mixture of experts with a shared expert",
    "qwen3_5": "hybrid linear/full attention, dense MLP (the text model)",
    "qwen3_5_moe": "hybrid linear/full attention, mixture of experts with a shared "
                   "expert (the text model)",
}
"""What each family's tiny model exercises beyond the plain decoder (docs/models.md)."""


def model_type(arch: str) -> str:
    """The ``model_type`` config.json holds for ``arch``."""
    return MODEL_TYPES.get(arch, arch)


def tiny_config(arch: str, *, vocab_size: int = VOCAB_SIZE) -> PretrainedConfig:
    """``arch``'s tiny config (see the module docstring), fp32, for a causal LM."""
    if arch not in FAMILY_KEYWORDS:
        raise ValueError(f"unknown architecture {arch!r}; one of {', '.join(ARCHITECTURES)}")
    keywords = {**_SHARED, **FAMILY_KEYWORDS[arch], "vocab_size": vocab_size}
    config = AutoConfig.for_model(model_type(arch), **keywords)
    config.dtype = torch.float32
    return config


def build_family_model(arch: str, out: str | Path, *, seed: int = 0) -> Path:
    """Saves a random fp32 ``arch`` model (``tiny_config``, drawn from ``seed``), its
    generation config and the byte tokenizer in ``out``; returns ``out``."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(str(directory))
    return directory
