"""RolloutPool: the live rollout workers, which one takes the next prompt, and replacing
the ones that are lost.

Owns: rank -> live worker, prompts in flight on each, and the restart policy: a dead,
broken or stuck worker is retired and a new one started in its place from the trainer's
current policy, up to ``rollout.max_restarts`` in all (counted in the run's totals, so a
resumed run keeps its count); past that, once no worker is left, the run fails. Knows
nothing about prompts, versions or the queue: the orchestrator passes in how to get the
current policy as a model folder.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

from async_rl.control.protocols import RolloutClient, RunFailed
from async_rl.control.step_metrics import StepTotals

Restart = Callable[[int, str, int], Awaitable[RolloutClient]]
"""(rank, model folder, its version) -> a started rollout worker."""
CurrentPolicy = Callable[[int], Awaitable[tuple[str, int]]]
"""rank -> (model folder, version) of the trainer's policy, written for that rank."""


class RolloutPool:
    """See the module docstring. ``workers`` is shared, not copied: others read it."""

    def __init__(self, workers: dict[int, RolloutClient], *, limit: int, max_restarts: int,
                 totals: StepTotals, restart: Restart | None,
                 current_policy: CurrentPolicy) -> None:
        self.workers = workers
        self.limit = limit
        """Prompts one worker generates at once (rollout.max_inflight_prompts)."""
        self.max_restarts = max_restarts
        self.totals = totals
        self.restart = restart
        self.current_policy = current_policy
        self.background: anyio.abc.TaskGroup | None = None
        """Where restarts run; None (before and after training): lost workers stay lost."""
        # Kept across restarts: calls on a dead worker give their slot back as they fail.
        self.busy = {rank: 0 for rank in workers}
        self._restarting = 0
        self._changed = anyio.Condition()
        """Notified when a worker frees a slot or a new one starts."""

    def full(self) -> bool:
        """No live worker can take another prompt now."""
        return not self.workers or min(self.busy[r] for r in self.workers) >= self.limit

    async def acquire(self, waiting: Callable[[], None]) -> tuple[int, RolloutClient]:
        """The least-busy live worker and its rank, with one of its slots taken (it may be
        lost before it is called: the call then fails like any on a lost worker);
        ``waiting`` is called each time it must wait for one."""
        async with self._changed:
            while self.full():
                waiting()
                await self._changed.wait()
            rank = min(self.workers, key=lambda r: self.busy[r])
            self.busy[rank] += 1
            return rank, self.workers[rank]

    async def release(self, rank: int) -> None:
        """Gives back a slot taken by ``acquire``."""
        async with self._changed:
            self.busy[rank] -= 1
            self._changed.notify_all()

    async def any_live(self) -> int:
        """The lowest live rank, waiting for a restart if none is live now."""
        async with self._changed:
            while not self.workers:
                if not self._restarting:
                    raise RunFailed("every rollout worker is gone "
                                    f"({self.totals.restarts} of {self.max_restarts} "
                                    "restarts used)")
                await self._changed.wait()
            return min(self.workers)

    def retire(self, rank: int, worker: RolloutClient, why: str) -> None:
        """Stops using a lost worker and starts a new one in its place while restarts are
        left; the run goes on with the others meanwhile."""
        if self.workers.get(rank) is not worker:
            return  # retired by another of its calls already (and maybe replaced)
        del self.workers[rank]
        self.totals.retired_workers += 1
        if (self.restart is not None and self.background is not None
                and self.totals.restarts < self.max_restarts):
            self.totals.restarts += 1
            print(f"rollout-{rank} lost ({why}): restarting it "
                  f"({self.totals.restarts} of {self.max_restarts} restarts)")
            self._restarting += 1
            self.background.start_soon(self._restart, rank)
        elif not self.workers and not self._restarting:
            raise RunFailed(f"every rollout worker is gone (last: rollout-{rank}: {why}; "
                            f"{self.totals.restarts} of {self.max_restarts} restarts used)")
        else:
            print(f"rollout-{rank} retired: {why}")

    async def _restart(self, rank: int) -> None:
        """A new engine for ``rank`` from the trainer's current policy and version."""
        try:
            model_dir, version = await self.current_policy(rank)
            assert self.restart is not None  # retire starts no restart without one
            worker = await self.restart(rank, model_dir, version)
            self.workers[rank] = worker
            print(f"rollout-{rank} restarted at version {version}")
        finally:
            self._restarting -= 1
            async with self._changed:  # admission or an evaluation may wait for it
                self._changed.notify_all()
