"""Errors the compute plane raises across its roles, and how any error is told in one line.

Owns: ``RolloutWorkerError`` (a rollout worker cannot generate: not started, shut down,
its cores unavailable, or a weight update failed), raised by the rollout engine and by
the engine's end of a weight update alike (the shell turns it into the protocols'
errors), and ``first_line`` (an exception as its type and the first line of its text:
every message of the project that names an exception says it this way).
"""

from __future__ import annotations


class RolloutWorkerError(RuntimeError):
    """The worker cannot generate: not started, shut down, or a weight update failed."""


def first_line(err: BaseException) -> str:
    """The exception in one line: its type, and the first line of its text when it has
    one (``"ValueError: bad input"``, or ``"ValueError"``): error messages name their
    cause in one line, whatever the exception's text holds."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
