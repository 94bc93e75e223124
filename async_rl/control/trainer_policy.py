"""The trainer's policy as the rest of a run sees it: its version and the lock it moves under.

Owns: the run's policy version (the label of every ledger event and published weights),
the step lock (held while the shards train and the version moves on: holding it, the
trainer's weights are exactly ``version``) and the copies of the policy written for a
restarting rollout engine, taken under that lock so that the engine starts from exactly
the version it is told. Built before the parts that read it (the ledger, the rollout
pool), which receive it instead of reaching back into the orchestrator. Knows nothing
about steps, queues or Ray.
"""

from __future__ import annotations

from pathlib import Path

import anyio

from async_rl.control.protocols import TrainerClient

RESTARTS = "restarts"
"""The run directory's folder of policies written for restarting rollout engines."""


class TrainerPolicy:
    """The version of trainer shard 0's policy, its step lock, and restart copies."""

    def __init__(self, shard: TrainerClient, run_dir: Path) -> None:
        """``shard``: the trainer shard that writes the copies (with ddp the shards are
        replicas); ``run_dir``: where they go (under ``restarts/``)."""
        self.shard, self.run_dir = shard, run_dir
        self.version = 0
        self.lock = anyio.Lock()
        """Held while shards train and ``version`` moves on."""

    def current(self) -> int:
        """The version now (what the ledger labels an event with)."""
        return self.version

    async def written_for(self, rank: int) -> tuple[str, int]:
        """The current policy written for rollout worker ``rank`` to restart from, and its
        version (under the step lock: exactly that version)."""
        async with self.lock:
            model_dir = self.run_dir / RESTARTS / f"rollout-{rank}-v{self.version}"
            await self.shard.save_policy(str(model_dir))
            return str(model_dir), self.version
