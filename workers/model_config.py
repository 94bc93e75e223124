"""The model section: which policy the rollout engines and the trainer shards run.

Owns: ``ModelConfig`` (the policy's directory, or hub id, and dtype) and
``kv_bytes_per_token`` (what a token's keys and values take, from its config.json).
Knows nothing about how either role loads it (a hub id is resolved to its directory
before the workers see it: ``async_rl.run.model_source``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

Dtype = Literal["float32", "bfloat16"]


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which policy to train."""

    path: str
    """A Hugging Face-format causal LM and its tokenizer: a local directory (`async-rl
    make-model` builds one), or a hub id such as "Qwen/Qwen2.5-0.5B-Instruct", found in
    the Hugging Face cache (HF_HOME, HF_HUB_CACHE) before Ray starts and downloaded into
    it first unless HF_HUB_OFFLINE is set; the run then uses, and its config.toml
    records, the snapshot directory. A path whose parent directory exists here is local."""
    dtype: Dtype = "float32"
    """Parameter dtype of the trainer (its master weights, gradients and optimizer
    state) and of the rollout engine unless rollout.dtype says otherwise."""


def kv_bytes_per_token(hf_config: Mapping[str, Any], width: float) -> float:
    """Bytes of keys and values one token holds in every layer of a Qwen2/Llama-style
    decoder, ``hf_config`` being its config.json and ``width`` the bytes of one value."""
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    kv_heads = hf_config.get("num_key_value_heads", heads)
    return float(2 * hf_config["num_hidden_layers"] * kv_heads * head_dim * width)
