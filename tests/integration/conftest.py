"""Shared fixtures of the integration tests (marker ``ray``): real Ray, real vLLM CPU build.

Owns: ``process_cores``, which starts each pytest-xdist process's runs on a core of its
own, ``ray_cluster``, a local Ray started per test module and always shut down
afterwards, so no Ray context leaks from one module into the next, and ``ray_shutdown``
(``ray_shutdown_module`` for a module's fixture), and the order the modules are handed to
the xdist processes in (``LONGEST_FIRST``).
The models the tests load (``tiny_model_dir`` and the rest) come from ``tests/conftest.py``,
built once per checkout. Knows nothing about the actors the tests start.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray

from async_rl.shell.ray_shell import LOCAL_RAY_SYSTEM
from workers import layout

LONGEST_FIRST = (
    "test_failures", "test_ppo_run", "test_stop_resume", "test_trainer", "test_moe_run",
    "test_rollout", "test_tune_run", "test_model_matrix_engine", "test_weight_faults",
    "test_engine_lending_run", "test_user_rewards_run", "test_environment_run",
    "test_multinode", "test_cpu_tools_run", "test_longtail_run",
)
"""The Ray tiers' modules that take longest, longest first (summed test time in the last
run of the tiers on two xdist processes, 223 s down to 41 s, test_stop_resume's less
its LoRA runs since folded into the others; the others took 40 s or less), handed out
before the rest (``make test`` runs them with ``--no-loadscope-reorder``): in the
collection's order, which xdist's own reordering (by test count) kept, a 134 s module
started last and one process finished alone.
"""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of ``LONGEST_FIRST`` first, in its order; the rest as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def process_cores(worker_id: str) -> Iterator[tuple[int, ...]]:
    """The cores this test process's runs lay their workers out on, rollout first.

    A run pins its rollout engine to the first core and its trainer to the next: two
    xdist processes laying out from core 0 both put their engines (and the engines'
    imports, the heaviest CPU work of a short run) on core 0 while core 1 held the
    trainers. Side by side, two 4-step runs took 77 s with the same layout and 63 s with
    the second one's rotated. So process ``gwN`` rotates the cores by N.
    """
    cores = layout.usable_cores()
    shift = int(worker_id.removeprefix("gw")) % len(cores) if worker_id != "master" else 0
    rotated = cores[shift:] + cores[:shift]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layout, "usable_cores", lambda: rotated)
        yield rotated


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A fresh local two-CPU Ray for one test module; shut down even when tests fail."""
    if ray.is_initialized():  # left over by something else: never share its state
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, address="local",
             _system_config=LOCAL_RAY_SYSTEM)
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
