"""Cores follow the bottleneck: the "shared" CPU layout and the "auto" choice.

Owns: the busy board (one byte per rollout worker in a small shared-memory file: 1 while
the worker's engine has requests in flight or is loading weights), the trainer's side of
sharing (``CoreShare``: before each forward, backward and optimizer phase it uses every
core while no rollout worker is busy, and only its own cores while one is). No torch, no
Ray at import time. When "auto" shares is decided by ``async_rl.control.auto_layout``.

Why the trainer adapts and not the engine: vLLM's CPU build binds its OpenMP threads
once, when the engine is built; torch's intra-op thread count can change between phases.
So "shared" gives the rollout worker's idle core time to the trainer (the bottleneck on
the CPU default) and never takes cores from a generating engine. When generation is the
bottleneck the rollout worker is almost never idle and shared behaves like split.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from pathlib import Path

BOARD_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
"""Where a run's board lives: shared memory where there is one (the board is read and
written before every trainer phase)."""


def create_board(directory: str, num_workers: int, run_tag: str) -> str:
    """A zeroed busy board for ``num_workers`` rollout workers; returns its path."""
    path = Path(directory) / f"async_rl-cores-{run_tag}"
    path.write_bytes(bytes(max(num_workers, 1)))
    return str(path)


class _Board:
    def __init__(self, path: str) -> None:
        self._file = open(path, "r+b")  # noqa: SIM115 - held open for the mmap's lifetime
        self.view = mmap.mmap(self._file.fileno(), 0)

    def close(self) -> None:
        self.view.close()
        self._file.close()


class BusyFlag:
    """The rollout worker's byte on the board, plus its busy seconds for "auto"."""

    def __init__(self, path: str, rank: int) -> None:
        self._board = _Board(path) if path else None
        self._rank = rank
        self._busy_since: float | None = None
        self._busy_s = 0.0

    def set(self, busy: bool) -> None:
        now = time.perf_counter()
        if busy and self._busy_since is None:
            self._busy_since = now
        elif not busy and self._busy_since is not None:
            self._busy_s += now - self._busy_since
            self._busy_since = None
        else:
            return
        if self._board is not None:
            self._board.view[self._rank] = 1 if busy else 0

    def busy_seconds(self) -> float:
        """Cumulative seconds busy (the current busy stretch included)."""
        current = time.perf_counter() - self._busy_since if self._busy_since else 0.0
        return self._busy_s + current


class CoreShare:
    """The trainer's side of "shared": its own cores, plus ``extra`` while rollout idles.

    ``enabled`` False (split, or auto before it picked) pins to ``own`` and never reads
    the board. Tracks thread-seconds over compute so the report's OS CPU-time check
    divides by the cores actually used (``mean_cores``).
    """

    def __init__(self, own: tuple[int, ...], extra: tuple[int, ...], board_path: str) -> None:
        available = os.sched_getaffinity(0)
        self._given_cores = bool(own)
        self.own = tuple(c for c in own if c in available) or tuple(sorted(available))
        self.all = tuple(sorted({*self.own, *(c for c in extra if c in available)}))
        self._board = _Board(board_path) if board_path else None
        self.enabled = False
        self._widened = False
        self.threads = 0 if own else 1
        self._since = 0.0
        self._thread_s = 0.0
        self._busy_s = 0.0

    def apply(self) -> int:
        """Sets threads (and affinity) for the next phase; returns the thread count."""
        if not self._given_cores:  # no cores of its own (tests, CUDA): leave torch alone
            self._account()
            self._since = time.perf_counter()
            return self.threads
        threads = len(self.own)
        if self.enabled and self._board is not None and not any(self._board.view[:]):
            threads = len(self.all)
        self._account()
        if not self.enabled and self._widened:  # sharing turned off: back to own cores
            _set_affinity_all_threads(self.own)
            self._widened = False
        if self.enabled and not self._widened:
            # Affinity stays wide once sharing is on; only the thread count follows the
            # board (narrowing the affinity too would stack torch's spinning pool
            # threads onto the trainer's own core).
            _set_affinity_all_threads(self.all)
            self._widened = True
        if threads != self.threads:
            import torch

            torch.set_num_threads(threads)
            self.threads = threads
        self._since = time.perf_counter()
        return self.threads

    def idle(self) -> None:
        """Compute ended (the step is done): stop counting thread-seconds."""
        self._account()
        self._since = 0.0

    def _account(self) -> None:
        if self._since:
            spent = time.perf_counter() - self._since
            self._busy_s += spent
            self._thread_s += spent * self.threads

    def mean_cores(self) -> float:
        """Threads used, averaged over compute time (len(own) before any compute)."""
        return self._thread_s / self._busy_s if self._busy_s else float(len(self.own))


def _set_affinity_all_threads(cores: tuple[int, ...]) -> None:
    """Every thread of this process (torch's OpenMP pool included) onto ``cores``."""
    wanted = set(cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, wanted)
        except OSError:  # a thread that just exited
            continue
