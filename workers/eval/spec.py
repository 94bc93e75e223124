"""What the idle-CPU evaluator is built from (``EvaluatorSpec``).

Owns: the frozen record a ``workers.eval.evaluator.IdleCpuEvaluator`` takes, filled by
the run's roster (``async_rl.roster``) or by a test or bench; what it gets of the task
is given beside it, at run time.
"""

from __future__ import annotations

import msgspec

from workers.model_config import ModelConfig


class EvaluatorSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The policy it loads and the completion cap of its greedy evaluations."""

    model: ModelConfig
    max_new_tokens: int
    """rollout.max_new_tokens: the cap a rollout worker's greedy evaluation has too."""
