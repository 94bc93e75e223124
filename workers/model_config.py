"""The model section: which policy the rollout engines and the trainer shards run.

Owns: ``ModelConfig`` (the policy's directory, or hub id, and dtype), ``LoraConfig``
(``[model.lora]``: low-rank adapters trained instead of the weights; what they do is
``workers.trainer.lora``'s), ``kv_bytes_per_token`` (what a token's keys and values
take, from its config.json) and ``lora_features`` (what LoRA adapters of each target
module hold per unit of rank, from the same file: the simulator's bytes per version).
Knows nothing about how either role loads it (a hub id is resolved to its directory
before the workers see it: ``async_rl.run.model_source``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from buffers.common.config import invalid

Dtype = Literal["float32", "bfloat16"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Qwen2/Llama-style decoder layer (attention and MLP)."""


class LoraConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[model.lora]``: train low-rank adapters (LoRA, through ``peft``) instead of the
    policy's weights; each weight version then carries only the adapters (docs/lora.md)."""

    rank: Annotated[int, msgspec.Meta(ge=0, le=512)] = 0
    """Rank of every adapter; > 0 turns LoRA on (the base weights are frozen, the
    optimizer holds the adapters only). At most 512 (vLLM's largest)."""
    alpha: Annotated[int, msgspec.Meta(ge=1)] = 16
    """Scaling numerator: an adapter adds (alpha / rank) x B A to its layer's weight."""
    dropout: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    """Dropout on the adapters' input while training (the engines and the log-probs of
    evaluation run without it)."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """Names of the linear layers that get an adapter (the last part of a module's name:
    every layer's ``q_proj``...); each must be a linear layer the model has, other than
    its LM head (``lm_head``: the fused head trains no adapter)."""

    def __post_init__(self) -> None:
        if self.rank and not self.target_modules:
            raise invalid("model.lora.target_modules", [], "name at least one linear layer "
                          f"when model.lora.rank > 0, e.g. {list(LORA_TARGETS)}")
        if len(set(self.target_modules)) < len(self.target_modules):
            raise invalid("model.lora.target_modules", list(self.target_modules),
                          "a module is named twice")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


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
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    """Low-rank adapters (``[model.lora]``, below); off by default (rank = 0)."""


def kv_bytes_per_token(hf_config: Mapping[str, Any], width: float) -> float:
    """Bytes of keys and values one token holds in every layer of a Qwen2/Llama-style
    decoder, ``hf_config`` being its config.json and ``width`` the bytes of one value."""
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    kv_heads = hf_config.get("num_key_value_heads", heads)
    return float(2 * hf_config["num_hidden_layers"] * kv_heads * head_dim * width)


def lora_features(hf_config: Mapping[str, Any]) -> dict[str, int]:
    """Per module name LoRA can target in a Qwen2/Llama-style decoder (``hf_config``: its
    config.json), its in + out features summed over the model's modules of that name (every
    decoder layer's ``q_proj``, ...; the head and the embeddings once). An adapter of rank
    r on a linear layer of ``in`` x ``out`` features holds r x (in + out) parameters (A is r
    x in, B out x r; an embedding's alike, vocabulary by hidden), so the adapters of
    ``target_modules`` hold r x the sum of their entries."""
    hidden, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    kv = hf_config.get("num_key_value_heads", heads) * head_dim
    mlp, vocab = hf_config["intermediate_size"], hf_config["vocab_size"]
    per_layer = {"q_proj": hidden + heads * head_dim, "k_proj": hidden + kv,
                 "v_proj": hidden + kv, "o_proj": heads * head_dim + hidden,
                 "gate_proj": hidden + mlp, "up_proj": hidden + mlp, "down_proj": mlp + hidden}
    return {name: layers * features for name, features in per_layer.items()} | {
        "lm_head": hidden + vocab, "embed_tokens": vocab + hidden}
