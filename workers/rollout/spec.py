"""What one rollout worker is built from (``RolloutSpec``).

Owns: the frozen record a ``workers.rollout.worker.RolloutWorker`` takes, the sections
it owns or runs and where it runs, filled by the run's roster (``async_rl.roster``) or
by a test or bench. What it gets of the task (``workers.rollout.task.WorkerTask``) and
the policy version it starts from are given beside it: they are known at run time.
"""

from __future__ import annotations

import msgspec

from workers.model_config import ModelConfig
from workers.rollout.config import RolloutConfig
from workers.weights.config import WeightsConfig


class RolloutSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One rollout worker: its rank, the sections it runs and the cores it owns."""

    rank: int
    model: ModelConfig
    """The policy it starts from (model.path: a resumed run's checkpoint folder)."""
    rollout: RolloutConfig
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    """How its weights arrive (weights.transport)."""
    seed: int = 0
    """The engine's (run.seed + rank: each worker its own stream)."""
    cpu_ids: tuple[int, ...] = ()
    """Cores it owns (CPU build only; ignored when CUDA is present): the engine's OpenMP
    threads are bound to them and the actor process, with the engine processes it
    spawns, is pinned to them. Empty: vLLM's automatic binding, no pinning."""
    worker_cpu_ids: tuple[int, ...] = ()
    """Cores its own process moves to once the engine is built, the engine's processes
    staying on ``cpu_ids`` (rollout.worker_cores = "trainer": the trainer shards'; CPU
    build only). Empty: it stays on ``cpu_ids``."""
    record_spans: bool = True
    """run.record_spans."""
