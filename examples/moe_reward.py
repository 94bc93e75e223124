"""A shaped reward for examples/cpu_moe.toml's random policy: the share of a completion's
characters that are digits, named there as

    [[task.rewards]]
    function = "examples/moe_reward.py:digit_share"

A random model almost never writes the right sum, so the built-in arithmetic reward would
score every sample 0 and give GRPO no advantage to train on; its samples do differ in
how many digits they hold, so this one gives every group a gradient.
"""

from __future__ import annotations


def digit_share(prompt: str, completion: str) -> float:
    text = completion.strip()
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0
