"""Shared fixtures of the integration tests (marker ``ray``): real Ray, real vLLM CPU build.

Owns: ``tiny_model_dir``, the project's tiny model built once per session into a temp
dir (nothing is downloaded), and ``ray_cluster``, a local Ray started per test module
and always shut down afterwards, so no Ray context leaks from one module into the next.
Knows nothing about the actors the tests start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from async_rl.models.tiny_model import make_model

TINY_MODEL_SFT_STEPS = 20
"""Enough warm start that greedy completions look like numbers; a few seconds here."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the tiny Qwen2 model and its tokenizer, built once per session."""
    out = tmp_path_factory.mktemp("tiny-model")
    make_model(out, seed=0, sft_steps=TINY_MODEL_SFT_STEPS, eval_size=16, log=None)
    return out


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A fresh local two-CPU Ray for one test module; shut down even when tests fail."""
    if ray.is_initialized():  # left over by something else: never share its state
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, address="local")
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def ray_shutdown() -> Iterator[None]:
    """For tests whose code under test starts its own Ray (run_training): none is left
    running before or after, whatever the outcome."""
    if ray.is_initialized():
        ray.shutdown()
    try:
        yield
    finally:
        ray.shutdown()
