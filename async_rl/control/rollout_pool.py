"""RolloutPool: the live rollout workers, which one takes the next prompt, and replacing
the ones that are lost.

Owns: the one map of live rollout workers (rank -> worker: only the pool changes it;
others get copies), prompts in flight on each, and the restart policy: a dead, broken or
stuck worker is retired and a new one started in its place from the trainer's current
policy, up to ``rollout.max_restarts`` in all (counted in the run's totals, so a resumed
run keeps its count); past that, once no worker is left, the run fails. Workers may be
added and taken out while the run trains (``join``, ``leave``: an engine count retuned).
A replacement that fails to start (or to answer within its deadline) is a failed
restart, counted, and its rank is lost like a worker: replaced again while restarts are
left. Restarts run in the pool's own task group, open while ``replacing()`` is; at its
exit a restart still under way gets run.call_timeout_s more, then it is cancelled and
counted as failed, so a replacement that hangs cannot stall the end of a run. Knows
nothing about prompts, versions or the queue: it is built with how to get the trainer's
current policy as a model folder (``TrainerPolicy.written_for``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager

import anyio
import anyio.abc

from async_rl.control.failures import RolloutFailed, RunFailed
from async_rl.control.protocols import RolloutClient, Workers
from async_rl.control.step_metrics import StepTotals
from workers.rollout.config import RolloutConfig

Restart = Callable[[int, str, int], Awaitable[RolloutClient]]
"""(rank, model folder, its version) -> a started rollout worker."""
CurrentPolicy = Callable[[int], Awaitable[tuple[str, int]]]
"""rank -> (model folder, version) of the trainer's policy, written for that rank."""

log = logging.getLogger(__name__)


class RolloutPool:
    """See the module docstring."""

    @classmethod
    def from_config(cls, rollout: RolloutConfig, workers: Workers, *, totals: StepTotals,
                    current_policy: CurrentPolicy, call_timeout_s: float) -> RolloutPool:
        """The pool of ``workers``' rollout workers, as its section says:
        rollout.max_inflight_prompts per worker, rollout.max_restarts replacements;
        ``call_timeout_s``: run.call_timeout_s, what ``replacing()`` waits at its exit."""
        return cls(workers.rollout, limit=rollout.max_inflight_prompts,
                   max_restarts=rollout.max_restarts, totals=totals,
                   restart=workers.restart_rollout, current_policy=current_policy,
                   exit_wait_s=call_timeout_s)

    def __init__(self, workers: Mapping[int, RolloutClient], *, limit: int, max_restarts: int,
                 totals: StepTotals, restart: Restart | None,
                 current_policy: CurrentPolicy, exit_wait_s: float) -> None:
        self._workers = dict(workers)
        self.limit = limit
        """Prompts one worker generates at once (rollout.max_inflight_prompts)."""
        self.max_restarts = max_restarts
        self.totals = totals
        self.restart = restart
        self.current_policy = current_policy
        self.exit_wait_s = exit_wait_s
        """How long ``replacing()`` waits at its exit for restarts under way before it
        cancels them."""
        self._restarts: anyio.abc.TaskGroup | None = None
        """Where restarts run, while ``replacing()`` is open; None: lost workers stay lost."""
        self._cancelled_why = "the run stopped"
        """What a restart cancelled now was cancelled for (logged)."""
        # Kept across restarts: calls on a dead worker give their slot back as they fail.
        self.busy = {rank: 0 for rank in workers}
        self._positions = itertools.count()
        self._position: dict[int, int] = {}
        """Each live worker's place in ``_workers``' order (a restarted one goes last)."""
        self._by_busy: list[list[tuple[int, int]]] = [[] for _ in range(limit + 1)]
        """Per count of slots taken, the live workers there as sorted (position, rank):
        the least busy is the first of the first non-empty list, which is what min()
        over ``_workers`` picks (ties to the earliest), without scanning every worker."""
        for rank in self._workers:
            self._place(rank)
        self._restarting = 0
        # The fast lock takes a free lock without a trip through the event loop: this
        # is taken twice per prompt, and nothing waits on it but the wait below.
        self._changed = anyio.Condition(anyio.Lock(fast_acquire=True))
        """Notified when a worker frees a slot or a new one starts."""

    @property
    def workers(self) -> dict[int, RolloutClient]:
        """The live workers, rank -> worker: a copy (only the pool changes the map)."""
        return dict(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    @asynccontextmanager
    async def replacing(self) -> AsyncIterator[None]:
        """While open, a lost worker is replaced (restarts left permitting); on exit it
        waits ``exit_wait_s`` at most for restarts under way, then cancels them (each a
        failed restart). Outside it, lost workers stay lost."""
        async with anyio.create_task_group() as restarts:
            self._restarts = restarts
            try:
                yield
                self._restarts = None  # no new restart from here
                with anyio.move_on_after(self.exit_wait_s):
                    async with self._changed:
                        while self._restarting:
                            await self._changed.wait()
                if self._restarting:
                    self._cancelled_why = (f"still under way {self.exit_wait_s:g} s after "
                                           "the run ended (run.call_timeout_s)")
                    restarts.cancel_scope.cancel()
            finally:
                self._restarts = None

    async def set_limit(self, limit: int) -> None:
        """A new rollout.max_inflight_prompts (a run retuned while it trains): raised,
        a wait for a slot goes on at once; lowered, workers above it finish what they
        hold and get no more until they are below it."""
        async with self._changed:
            self.restore_limit(limit)
            self._changed.notify_all()

    def restore_limit(self, limit: int) -> None:
        """``set_limit`` before the run starts (a resumed run's tuned value: nothing
        waits for a slot yet)."""
        if limit < 1:
            raise ValueError(f"limit={limit}: must be >= 1")
        self._by_busy += [[] for _ in range(limit + 1 - len(self._by_busy))]
        self.limit = limit

    async def join(self, rank: int, worker: RolloutClient) -> None:
        """A worker added while the run trains (``[autopilot]``'s engine count): live from
        now, last in order, its slots those its rank still holds."""
        async with self._changed:
            self._workers[rank] = worker
            self.busy.setdefault(rank, 0)
            self._place(rank)
            self._changed.notify_all()

    def leave(self, rank: int) -> RolloutClient:
        """Takes live ``rank`` out of the pool (an engine removed): no prompt goes to it
        from now; its calls in flight give their slots back as they end."""
        worker = self._workers.pop(rank)
        self._unplace(rank)
        return worker

    def full(self) -> bool:
        """No live worker can take another prompt now."""
        return not any(self._by_busy[:self.limit])

    async def acquire(self, waiting: Callable[[], None]) -> tuple[int, RolloutClient]:
        """The least-busy live worker and its rank, with one of its slots taken (it may be
        lost before it is called: the call then fails like any on a lost worker);
        ``waiting`` is called each time it must wait for one."""
        async with self._changed:
            while self.full():
                waiting()
                await self._changed.wait()
            rank = next(level[0][1] for level in self._by_busy if level)
            self._move(rank, +1)
            return rank, self._workers[rank]

    async def release(self, rank: int) -> None:
        """Gives back a slot taken by ``acquire``."""
        async with self._changed:
            self._move(rank, -1)
            self._changed.notify_all()

    def _place(self, rank: int, position: int | None = None) -> None:
        """Files a live worker under its slots taken; a new one (no position) goes last."""
        if position is None:
            position = next(self._positions)
        self._position[rank] = position
        bisect.insort(self._by_busy[self.busy[rank]], (position, rank))

    def _unplace(self, rank: int) -> int:
        """Takes a live worker out of ``_by_busy``; returns its position."""
        position = self._position.pop(rank)
        level = self._by_busy[self.busy[rank]]
        del level[bisect.bisect_left(level, (position, rank))]
        return position

    def _move(self, rank: int, by: int) -> None:
        """Changes the slots taken on ``rank`` (live or not: calls on a lost worker give
        theirs back too) by ``by``."""
        position = self._unplace(rank) if rank in self._position else None
        self.busy[rank] += by
        if position is not None:
            self._place(rank, position)

    async def any_live(self) -> tuple[int, RolloutClient]:
        """The live worker of lowest rank, and its rank, waiting for a restart if none is
        live now."""
        async with self._changed:
            while not self._workers:
                if not self._restarting:
                    raise RunFailed("every rollout worker is gone "
                                    f"({self.totals.restarts} of {self.max_restarts} "
                                    "restarts used)")
                await self._changed.wait()
            rank = min(self._workers)
            return rank, self._workers[rank]

    def retire(self, rank: int, worker: RolloutClient, why: str) -> None:
        """Stops using a lost worker and starts a new one in its place while restarts are
        left; the run goes on with the others meanwhile."""
        if self._workers.get(rank) is not worker:
            return  # retired by another of its calls already (and maybe replaced)
        del self._workers[rank]
        self._unplace(rank)
        self.totals.retired_workers += 1
        self._replace_or_give_up(rank, why)

    def _replace_or_give_up(self, rank: int, why: str) -> None:
        """Starts a new worker for lost ``rank`` while restarts are left; raises
        ``RunFailed`` once no worker is left and none is starting."""
        if (self.restart is not None and self._restarts is not None
                and self.totals.restarts < self.max_restarts):
            self.totals.restarts += 1
            log.info("rollout-%d lost (%s): restarting it (%d of %d restarts)",
                     rank, why, self.totals.restarts, self.max_restarts)
            self._restarting += 1
            self._restarts.start_soon(self._replace, rank)
        elif not self._workers and not self._restarting:
            raise RunFailed(f"every rollout worker is gone (last: rollout-{rank}: {why}; "
                            f"{self.totals.restarts} of {self.max_restarts} restarts used)")
        else:
            log.info("rollout-%d retired: %s", rank, why)

    async def _replace(self, rank: int) -> None:
        """A new engine for ``rank`` from the trainer's current policy and version; one
        that fails to start is lost in its turn."""
        failed = ""
        try:
            model_dir, version = await self.current_policy(rank)
            assert self.restart is not None  # retire starts no restart without one
            worker = await self.restart(rank, model_dir, version)
            self._workers[rank] = worker
            self._place(rank)
            log.info("rollout-%d restarted at version %d", rank, version)
        except RolloutFailed as err:  # the replacement died, broke or did not answer
            failed = err.reason
        except anyio.get_cancelled_exc_class():
            self.totals.failed_restarts += 1
            log.warning("rollout-%d: its restart was cancelled, %s", rank,
                        self._cancelled_why)
            raise
        finally:
            self._restarting -= 1
            async with self._changed:  # admission or an evaluation may wait for it
                self._changed.notify_all()
        if failed:
            self.totals.failed_restarts += 1
            log.warning("rollout-%d: its restart failed: %s", rank, failed)
            if self._restarts is not None:  # not at the run's end: lost like a worker
                self._replace_or_give_up(rank, f"its restart failed: {failed}")
