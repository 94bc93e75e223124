"""What a model's own LM head does to ``h W^T + b`` before the sampler sees the logits.

Owns: ``HeadTransform`` (a frozen record: a soft cap, then a multiplier) and
``head_transform``, which reads it from a Hugging Face config: Gemma 2 and 3's
``final_logit_softcapping`` (``cap * tanh(z / cap)``), Cohere's ``logit_scale`` and
Falcon-H1's ``lm_head_multiplier`` (multiplied), Granite's ``logits_scaling`` (divided; the
same key multiplies in HyperCLOVA X). The order is vLLM's ``LogitsProcessor``'s (soft cap,
then scale) and the sampling temperature divides after both, as vLLM's sampler does: the
fused head (``workers.trainer.lm_head``) computes the distribution the engine sampled
from. Also the transform's elementwise math on a chunk of float32 logits, forward
(``apply_``) and its derivative (``slope``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MULTIPLIERS = ("logit_scale", "lm_head_multiplier")
"""Config keys whose value multiplies the logits (Cohere's, Falcon-H1's)."""
DIVISOR = "logits_scaling"
"""Granite's key, whose value divides the logits (MiniCPM3 divides the hidden states by
it before its bias-free head: the same)."""
MULTIPLIED_BY_DIVISOR = frozenset({"hyperclovax"})
"""Model types whose ``logits_scaling`` multiplies instead (muP)."""


@dataclass(frozen=True, slots=True)
class HeadTransform:
    """``scale * softcap * tanh(z / softcap)`` (without a soft cap, ``scale * z``) of the
    head's affine output ``z``. The default changes nothing."""

    scale: float = 1.0
    softcap: float | None = None

    def factor(self, temperature: float) -> float:
        """What multiplies the (capped) logits once the temperature divides them too."""
        return self.scale / temperature

    def apply_(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """``logits`` (float32, the head's affine output) transformed and divided by
        ``temperature``, in place; returned."""
        factor = self.factor(temperature)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_()
            factor *= self.softcap
        if factor != 1.0:
            logits.mul_(factor)
        return logits

    def slope(self, transformed: torch.Tensor, temperature: float) -> torch.Tensor | float:
        """The derivative of ``apply_`` at each element, from its output: the constant
        factor without a soft cap, else ``factor * (1 - tanh^2)`` as a new tensor (the
        tanh is the output over ``factor * softcap``: nothing else need be kept)."""
        factor = self.factor(temperature)
        if self.softcap is None:
            return factor
        return transformed.square().mul_(-1.0 / (factor * self.softcap) ** 2).add_(1.0) \
            .mul_(factor)


def head_transform(config: Any) -> HeadTransform:
    """The transform the model of Hugging Face ``config`` applies to its head's output
    (a composite model's text config is read)."""
    text = config.get_text_config(decoder=True)
    scale = 1.0
    for key in MULTIPLIERS:
        value = getattr(text, key, None)
        if value is not None:
            scale *= float(value)
    divisor = getattr(text, DIVISOR, None)
    if divisor is not None:
        multiplies = getattr(text, "model_type", "") in MULTIPLIED_BY_DIVISOR
        scale = scale * float(divisor) if multiplies else scale / float(divisor)
    softcap = getattr(text, "final_logit_softcapping", None)
    return HeadTransform(scale=scale, softcap=float(softcap) if softcap else None)
