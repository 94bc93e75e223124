"""The models the test tiers need, one function each, and a command that builds them all.

Owns: what each test model is (``tiny_model``, ``learnable_model``, ``longtail_model``,
``calculator_model``: the arguments of ``async_rl.models.tiny_model.make_model`` each is
built with, through ``model_cache.cached_model``). The fixtures in ``tests/conftest.py``
call these; ``python tests/models.py`` builds every one that is not cached yet, so
``make test`` can build them while it lints and type-checks instead of inside the first
test that needs each (the learnable model's warm start alone takes about two minutes).
The cache's lock makes a fixture that asks meanwhile wait for the build, not repeat it.
"""

from __future__ import annotations

from pathlib import Path

from model_cache import cached_model

TINY_MODEL_SFT_STEPS = 20
"""Enough warm start that greedy completions look like numbers; a few seconds here."""
LONGTAIL_SFT_STEPS = 20
"""Enough warm start that sampled traces end in EOS at many lengths (a model that never
stopped would make every completion max_new_tokens long); a few seconds."""
LONGTAIL_SFT_BATCH = 32
CALCULATOR_SFT_STEPS = 60
"""Enough warm start that about half the sampled first turns end in a tool call
(``<call>...</call>``, often a garbled one); 30 steps gave 1 in 13. About 30 s here, far
from the 800 steps (base accuracy 0.385) that examples/cpu_tools.toml's model gets."""


def tiny_model() -> Path:
    """The project's tiny Qwen2 model and its tokenizer, with a short warm start."""
    return cached_model(seed=0, sft_steps=TINY_MODEL_SFT_STEPS, eval_size=16)


def learnable_model() -> Path:
    """The CPU default's small model, fully warm-started (base greedy accuracy about 0.2)."""
    from async_rl.models.tiny_model import SMALL

    return cached_model(size=SMALL, seed=0, eval_size=64, num_threads=2)


def longtail_model() -> Path:
    """A tiny model warm-started on the long-tail (remainder) task."""
    from async_rl.models.tiny_model import LONGTAIL, TINY

    return cached_model(size=TINY, task=LONGTAIL, seed=0, sft_steps=LONGTAIL_SFT_STEPS,
                        batch_size=LONGTAIL_SFT_BATCH, eval_size=4)


def calculator_model() -> Path:
    """A tiny model warm-started briefly on the calculator tool task."""
    from async_rl.models.tiny_model import CALCULATOR, TINY

    return cached_model(size=TINY, task=CALCULATOR, seed=0, sft_steps=CALCULATOR_SFT_STEPS,
                        eval_size=8)


if __name__ == "__main__":
    # The slowest first: the tiers that need none of them start meanwhile.
    for build in (learnable_model, calculator_model, longtail_model, tiny_model):
        build()
