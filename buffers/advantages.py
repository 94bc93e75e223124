"""GRPO's group-normalised advantages, computed from a group's rewards (metadata only).

Owns: ``group_advantages`` and its scaling choices (``AdvantageStd``,
``trainer.advantage_std``). Knows nothing about tokens, tensors or the loss: the
control plane gives every sample its advantage before the plan is made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageStd = Literal["sample", "population", "none"]


def group_advantages(rewards: Sequence[float], std: AdvantageStd = "sample",
                     eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) within one group (``trainer.advantage_std``).

    ``std``: "sample" (n - 1), "population" (n) or "none" (r - mean, no scaling). A group
    whose rewards are all equal, a group of one included, gets zeros.
    """
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    deviations = [r - mean for r in rewards]
    squares = sum(d * d for d in deviations)
    if math.sqrt(squares / n) < eps:
        return [0.0] * n
    if std == "none":
        return deviations
    spread = math.sqrt(squares / (n - 1 if std == "sample" else n))
    return [d / (spread + eps) for d in deviations]
