"""Which models the packed trainer path cannot compute exactly, told from their config.

Owns: ``packed_support``: given a model's Hugging Face config (config.json, no weights),
the one-line reason the packed layout (``trainer.packed = true``: ``workers.trainer.
packing`` with ``workers.trainer.attention``'s attention and ``workers.trainer.lm_head``'s
fused head) would give log-probs other than the model's own, or None where it gives the
same. ``async_rl.run.inputs`` turns a reason into a refusal at start (exit 2).

What the packed path computes: causal attention per sequence, with a sliding window,
Gemma 2's soft-capping and gpt-oss's sinks; the linear-attention layers (gated
delta-nets) of ``LINEAR_ATTENTION_TYPES`` run once per sequence; per-token layers (MLPs,
mixtures of experts, norms) see only real tokens. What it does not: attention that is
not causal, a layer type it has no rule for (chunked or indexed attention), linear
attention of other families, and state-space or convolution layers whose state would
run from one packed sequence into the next. The model matrix
(``tests/unit/test_model_matrix.py``) checks every family let through against the
model's own padded forward, and these refusals.
"""

from __future__ import annotations

from typing import Any

PACKED_OFF = "set trainer.packed = false"
"""How a refused model still trains: the padded layout runs the model's own layers."""
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
"""``layer_types`` entries the packed attention computes."""
LINEAR_ATTENTION_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                                    "qwen3_5_moe_text"})
"""Model types whose ``linear_attention`` layers (gated delta-nets) run per sequence."""
RECURRENT_KEYS = ("mamba_d_state", "ssm_state_size", "state_size", "conv_L_cache",
                  "lru_width", "rescale_every", "inference_state_dtype")
"""Config keys of a state-space, recurrent or short-convolution layer (Mamba and its
hybrids, LFM2, RecurrentGemma, RWKV, xLSTM): each carries state from token to token."""


def packed_support(hf_config: Any) -> str | None:
    """Why the packed path cannot train a model of ``hf_config`` (a transformers
    ``PretrainedConfig``; a multimodal one is judged by its text model), in one line
    naming its ``model_type`` and the feature; None when it can."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    arch = getattr(text, "model_type", None) or getattr(hf_config, "model_type", "model")
    if getattr(text, "use_bidirectional_attention", None):
        return (f"{arch}: bidirectional attention with packed sequences is not supported "
                f"(the packed attention is causal); {PACKED_OFF}")
    recurrent = [key for key in RECURRENT_KEYS if getattr(text, key, None) is not None]
    if recurrent:
        return (f"{arch}: recurrent, state-space or convolution layers ({recurrent[0]}) "
                f"with packed sequences are not supported (their state would cross "
                f"sequences); {PACKED_OFF}")
    layer_types = set(getattr(text, "layer_types", None) or ())
    if arch in LINEAR_ATTENTION_TYPES:
        layer_types.discard("linear_attention")
    unknown = sorted(layer_types - ATTENTION_LAYERS)
    if unknown:
        return (f"{arch}: {unknown[0]} layers with packed sequences are not supported; "
                f"{PACKED_OFF}")
    return None
