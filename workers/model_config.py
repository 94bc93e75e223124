"""The model section: which policy the rollout engines and the trainer shards run.

Owns: ``ModelConfig`` (the policy's directory, or hub id, and dtype). Knows nothing about
how either role loads it (a hub id is resolved to its directory before the workers see
it: ``async_rl.run.model_source``).
"""

from __future__ import annotations

from typing import Literal

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
