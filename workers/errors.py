"""Errors the compute plane raises across its roles.

Owns: ``RolloutWorkerError`` (a rollout worker cannot generate: not started, shut down,
its cores unavailable, or a weight update failed), raised by the rollout engine and by
the engine's end of a weight update alike. The shell turns it into the protocols' errors.
"""

from __future__ import annotations


class RolloutWorkerError(RuntimeError):
    """The worker cannot generate: not started, shut down, or a weight update failed."""
