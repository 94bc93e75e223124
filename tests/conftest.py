"""Fixtures every tier may use: the models the tests need, each built once per checkout.

Owns: ``tiny_model_dir`` (the project's tiny model, a short warm start),
``learnable_model_dir`` (the CPU default's small model, fully warm-started, for tests that
must see RL learn) and ``longtail_model_dir`` (a tiny model warm-started on the long-tail
task) and ``calculator_model_dir`` (a tiny model with a short warm start on the
calculator tool task). Each is built by ``async_rl.models.tiny_model.make_model`` through
``model_cache.cached_model``: once, into a cache keyed by the builder's code and
arguments, then reused by later sessions until the builder changes (nothing is
downloaded). The builder is imported only by the fixtures, so collecting a tier that
needs no model stays light. Tests must treat these directories as read-only; one found
modified is rebuilt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from model_cache import cache_root, cached_model, made_record

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


def pytest_report_header(config: pytest.Config) -> str:
    return f"model cache: {cache_root()} (set ASYNC_RL_TEST_CACHE to move it)"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Directory of the tiny Qwen2 model and its tokenizer."""
    return cached_model(seed=0, sft_steps=TINY_MODEL_SFT_STEPS, eval_size=16)


@pytest.fixture(scope="session")
def learnable_model_dir() -> Path:
    """The CPU default's small model (base greedy accuracy about 0.2): the tiny fixture
    has too little capacity for RL to lift its accuracy within a test's steps. Its full
    warm start takes about two minutes on two idle cores, once per checkout."""
    from async_rl.models.tiny_model import SMALL

    out = cached_model(size=SMALL, seed=0, eval_size=64, num_threads=2)
    assert made_record(out).base_accuracy < 0.5
    return out


@pytest.fixture(scope="session")
def longtail_model_dir() -> Path:
    """A tiny model warm-started on the long-tail (remainder) task."""
    from async_rl.models.tiny_model import LONGTAIL, TINY

    out = cached_model(size=TINY, task=LONGTAIL, seed=0, sft_steps=LONGTAIL_SFT_STEPS,
                       batch_size=LONGTAIL_SFT_BATCH, eval_size=4)
    assert made_record(out).task == "longtail"
    return out


@pytest.fixture(scope="session")
def calculator_model_dir() -> Path:
    """A tiny model warm-started briefly on the calculator tool task: it calls the tool
    (often with a wrong expression) but hardly ever answers right."""
    from async_rl.models.tiny_model import CALCULATOR, TINY

    out = cached_model(size=TINY, task=CALCULATOR, seed=0, sft_steps=CALCULATOR_SFT_STEPS,
                       eval_size=8)
    assert made_record(out).task == "calculator"
    return out
