"""A reward written for verl: ``compute_score(data_source, solution_str, ground_truth,
extra_info=None)``, named by ``examples/verl_reward.toml`` as

    [[task.rewards]]
    function = "examples/verl_reward.py:compute_score"

It is called per sample; the returned dict's ``score`` is the reward and every other key
is logged per step as ``reward/compute_score/<key>``.
"""

from __future__ import annotations

import re
from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | None = None) -> dict[str, float]:
    found = re.match(r"\s*(-?\d+)", solution_str)
    correct = found is not None and found.group(1) == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0,
            "formatted": 1.0 if found is not None else 0.0}
