"""Keeps a benchmark's stdout for its one JSON object.

Owns ``stdout_to_stderr``: while it is open, file descriptor 1 points at stderr, so the
output of everything running meanwhile (vLLM engine processes, Ray workers' forwarded
logs, the controller's tables) goes to stderr, and ``--json`` output stays parseable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """Points fd 1 at stderr for the block (a no-op when ``enabled`` is false)."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
