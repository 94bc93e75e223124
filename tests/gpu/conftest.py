"""The GPU tier: every test here carries the ``gpu`` marker and is skipped without CUDA."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (and the CUDA build of vLLM: the gpu extra)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
