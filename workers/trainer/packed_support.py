"""Which model features the packed trainer path cannot compute exactly, from the config.

Owns: ``packed_support``: given a model's Hugging Face config (config.json, no weights),
the one-line reason the packed layout (``trainer.packed = true``: ``workers.trainer.
packing`` with ``workers.trainer.attention``'s attention and ``workers.trainer.lm_head``'s
fused head) would give log-probs other than the model's own, or None where it gives the
same. ``async_rl.run.inputs`` turns a reason into a refusal at start (exit 2). The model
matrix (``tests/unit/test_model_matrix.py``) checks every family it lets through against
the model's own padded forward, and every family it stops by this reason.
"""

from __future__ import annotations

from typing import Any

PACKED_OFF = "set trainer.packed = false"
"""How a refused model still trains: the padded layout runs the model's own attention
and head."""


def packed_support(hf_config: Any) -> str | None:
    """Why the packed path cannot train a model of ``hf_config`` (a transformers
    ``PretrainedConfig``), in one line naming its ``model_type`` and the feature; None
    when it can."""
    arch = getattr(hf_config, "model_type", "model")
    if getattr(hf_config, "attn_logit_softcapping", None):
        # tanh-capped attention scores: no SDPA or varlen flash kernel takes a soft cap.
        return (f"{arch}: attention soft-capping (attn_logit_softcapping) with packed "
                f"sequences is not supported; {PACKED_OFF}")
    if getattr(hf_config, "use_bidirectional_attention", None):
        return (f"{arch}: bidirectional attention with packed sequences is not supported "
                f"(the packed attention is causal); {PACKED_OFF}")
    return None
