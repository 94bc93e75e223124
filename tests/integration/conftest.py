"""Shared fixtures of the integration tests (marker ``ray``): real Ray, real vLLM CPU build.

Owns: ``ray_cluster``, a local Ray started per test module and always shut down
afterwards, so no Ray context leaks from one module into the next, and ``ray_shutdown``
(``ray_shutdown_module`` for a module's fixture).
The models the tests load (``tiny_model_dir`` and the rest) come from ``tests/conftest.py``,
built once per checkout. Knows nothing about the actors the tests start.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray


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


@contextmanager
def no_ray_left() -> Iterator[None]:
    """No Ray running before or after the block, whatever the outcome."""
    if ray.is_initialized():
        ray.shutdown()
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def ray_shutdown() -> Iterator[None]:
    """For tests whose code under test starts its own Ray (run_training)."""
    with no_ray_left():
        yield


@pytest.fixture(scope="module")
def ray_shutdown_module() -> Iterator[None]:
    """``ray_shutdown`` for a module's fixture that runs once for several tests."""
    with no_ray_left():
        yield
