"""Seconds a trainer step spends in each phase, without making the host wait for them.

Owns: ``PhaseClock``. On the CPU a boundary is ``time.perf_counter()``. On CUDA kernels
run asynchronously, so a host clock read at a boundary times the queuing, not the work;
synchronising at every boundary (what the trainer did before) stops the host from
queuing ahead and adds host and device time up. Here a boundary records a CUDA event on
the stream instead, and ``totals`` reads the events' elapsed times once the step's one
host read has waited for the stream anyway (the phases end with ``start(None)`` before
that read, so every event is done by then: waiting on the last one costs nothing, and
``torch.cuda.set_sync_debug_mode`` does not count event waits).
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import torch


class PhaseClock:
    """Marks phase boundaries on one device; ``totals`` sums each phase's seconds."""

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self._marks: list[tuple[str | None, torch.cuda.Event | float]] = []

    def _mark(self) -> torch.cuda.Event | float:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, phase: str | None) -> None:
        """Ends the running phase (if any) here and starts ``phase`` (None: no phase,
        the time until the next ``start`` is not counted)."""
        self._marks.append((phase, self._mark()))

    def totals(self) -> dict[str, float]:
        """Seconds per phase since the clock was made; a phase still running ends now.
        On CUDA, call after a host read that waited for the stream."""
        if not self._marks or self._marks[-1][0] is not None:
            self.start(None)
        last = self._marks[-1][1]
        if isinstance(last, torch.cuda.Event):
            last.synchronize()  # elapsed_time refuses an event not yet reached
        out: dict[str, float] = defaultdict(float)
        for (phase, began), (_, ended) in itertools.pairwise(self._marks):
            if phase is None:
                continue
            if isinstance(began, float) and isinstance(ended, float):
                out[phase] += ended - began
            elif isinstance(began, torch.cuda.Event) and isinstance(ended, torch.cuda.Event):
                out[phase] += began.elapsed_time(ended) / 1e3
        self._marks.clear()
        return dict(out)
