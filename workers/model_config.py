"""The model section: which policy the rollout engines and the trainer shards run.

Owns: ``ModelConfig`` (the policy's directory and dtype). Knows nothing about how either
role loads it.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which policy to train."""

    path: str
    """Directory of a Hugging Face-format causal LM and its tokenizer (`async-rl make-model`)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype in the rollout engine and the trainer."""
