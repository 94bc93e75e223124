"""Fixtures shared by the unit tests that run a tiny torch model."""

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    # Tiny matmuls: a second intra-op thread only adds synchronisation, which on a busy
    # 2-core machine turns milliseconds into seconds.
    import torch  # here, so that unit tests without torch do not pay for its import

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
