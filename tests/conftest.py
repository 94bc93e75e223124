"""Fixtures every tier may use: the models the tests need, each built once per checkout.

Owns: ``tiny_model_dir`` (the project's tiny model, a short warm start),
``learnable_model_dir`` (the CPU default's small model, fully warm-started, for tests that
must see RL learn) and ``longtail_model_dir`` (a tiny model warm-started on the long-tail
task) and ``calculator_model_dir`` (a tiny model with a short warm start on the
calculator tool task). Each is what ``tests/models.py`` says it is, built by
``async_rl.models.tiny_model.make_model`` through ``model_cache.cached_model``: once,
into a cache keyed by the builder's code and arguments, then reused by later sessions
until the builder changes (nothing is downloaded). The builder is imported only when a
fixture builds, so collecting a tier that needs no model stays light. Tests must treat
these directories as read-only; one found modified is rebuilt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from model_cache import cache_root, made_record
from models import calculator_model, learnable_model, longtail_model, tiny_model


def pytest_report_header(config: pytest.Config) -> str:
    return f"model cache: {cache_root()} (set ASYNC_RL_TEST_CACHE to move it)"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Directory of the tiny Qwen2 model and its tokenizer."""
    return tiny_model()


@pytest.fixture(scope="session")
def learnable_model_dir() -> Path:
    """The CPU default's small model (base greedy accuracy about 0.2): the tiny fixture
    has too little capacity for RL to lift its accuracy within a test's steps. Its full
    warm start takes about two minutes on two idle cores, once per checkout."""
    out = learnable_model()
    assert made_record(out).base_accuracy < 0.5
    return out


@pytest.fixture(scope="session")
def longtail_model_dir() -> Path:
    """A tiny model warm-started on the long-tail (remainder) task."""
    out = longtail_model()
    assert made_record(out).task == "longtail"
    return out


@pytest.fixture(scope="session")
def calculator_model_dir() -> Path:
    """A tiny model warm-started briefly on the calculator tool task: it calls the tool
    (often with a wrong expression) but hardly ever answers right."""
    out = calculator_model()
    assert made_record(out).task == "calculator"
    return out
