"""Devices lent between the roles in the simulator (simulate.lend).

Owns: ``SimLending``, trainer (or spare) devices that serve as extra rollout engines
while a run trains, by one of two rules, and ``lend_plan`` (how many engines those
devices make, the config checked). The extra engines have ranks from rollout.num_workers up;
they join and leave the real orchestrator's ``RolloutPool`` (``join``, ``leave``):

- **"starvation"**, verl's separate_async switch (its ``enable_switch``): at the end of a
  step whose trainer waited for its groups at least simulate.lend_wait of the step (from
  the previous step's end to this one's start), while the replay queue holds fewer
  groups than the next step takes, every lendable engine starts on the trainer's
  devices; once the next step's groups are in hand (the step's call on the shards) they
  all go back before it trains. The trainer does not train while lent (it waits anyway).
- **"autopilot"**: the autopilot's engine count (``async_rl.control.autopilot``,
  ``ENGINES``): the real ``LiveTuning`` calls ``add`` and ``remove`` (``EngineLending``)
  between steps. The trainer trains on the devices left: a step's compute takes
  ``T / (T - lent)`` times as long (``compute_factor``; the optimizer update and the
  gradient all-reduce keep their cost). With simulate.spare_devices the engines come
  from those instead: the trainer keeps its devices, and an engine starts by receiving
  the version over the weight path (a broadcast to one) and loading it.

A lend pays a colocated refit's reload of the devices moved (``async_rl.sim.refit``: the
trainer's state on them to host memory, the weights resharded into the engine's layout,
the version copied in), a return its release (the engine's memory freed, the trainer's
state back), every device moving its own share at once. A lent engine starts at the
trainer's version (a broadcast of that version skips it). A returned engine's requests
end there (vLLM's abort) and resume on the least busy standing engine with the tokens
they made (partial rollout: a prefill of them, then the rest; ``SimRollout``), beyond
its in-flight limit, so the orchestrator sees a slow group, not a failure. Lent engines
record no spans: the idle table is the standing engines' and the trainer's (the
trainer's lent time is its ``wait_data``); the lending has its own line of the result
(``LendRecord``). Knows nothing about the orchestrator's rules.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.abc

from async_rl.analysis.results import LendRecord
from async_rl.config import Config
from async_rl.control.protocols import RolloutClient
from async_rl.control.rollout_pool import RolloutPool
from async_rl.sim.costs import Costs
from async_rl.sim.engine import SimEngine
from async_rl.sim.rollout import Clock
from buffers.common.config import ConfigError


def lend_plan(config: Config, costs: Costs) -> tuple[int, int, int]:
    """(engines the lent devices make at most, devices one spans, the trainer's devices);
    a ConfigError naming the key where lending cannot be simulated."""
    sim, h = config.simulate, costs.hardware
    per_engine, per_shard = h.devices_per_rollout_worker, h.devices_per_trainer_shard
    trainer = config.trainer.num_shards * per_shard
    if sim.spare_devices and sim.lend != "autopilot":
        raise ConfigError(f"config error: simulate.spare_devices = {sim.spare_devices}: "
                          'only simulate.lend = "autopilot" adds engines on spare devices')
    if sim.lend == "off":
        return 0, per_engine, trainer
    arm = f'config error: simulate.lend = "{sim.lend}"'
    if config.run.colocate == "time":
        raise ConfigError(f'{arm}: the roles take turns on the same devices already '
                          '(run.colocate = "time")')
    if sim.preemption_step:
        raise ConfigError(f"{arm}: not with simulate.preemption_step (a lent engine's "
                          "aborted requests are not counted there)")
    if sim.lend == "autopilot" and not config.autopilot.enabled:
        raise ConfigError(f"{arm}: the autopilot decides the engine count: set "
                          "autopilot.enabled = true")
    keep = per_shard if sim.lend == "autopilot" else 0  # the trainer keeps one replica
    most = (sim.spare_devices or max(trainer - keep, 0)) // per_engine
    if sim.lend_engines > most:
        source = (f"{sim.spare_devices} spare devices" if sim.spare_devices
                  else f"trainer's {trainer} devices")
        raise ConfigError(
            f"config error: simulate.lend_engines = {sim.lend_engines}: the {source} make "
            f"at most {most} engines of {per_engine}"
            + (f" and keep one replica's {keep}" if keep and not sim.spare_devices else ""))
    return (most if sim.lend_engines < 0 else sim.lend_engines), per_engine, trainer


class SimLending:
    """See the module docstring: the lendable engines, their moves and their count. As
    ``EngineLending``: ``engines``, ``devices_per_engine``, ``trainer_devices``, ``add``,
    ``remove``."""

    def __init__(self, config: Config, costs: Costs, clock: Clock,
                 engines: dict[int, SimEngine], kv_limit: float | None,
                 client: Callable[[int, SimEngine, Callable[[], SimEngine]], RolloutClient]
                 ) -> None:
        """``engines``: the standing ones, by rank (the lendable ones are added to it);
        ``client``: a rollout worker over (rank, engine, its fallback engine)."""
        self.config, self.costs, self.clock = config, costs, clock
        self.arm = config.simulate.lend
        count, self.devices_per_engine, self.trainer = lend_plan(config, costs)
        self.spare_devices = config.simulate.spare_devices
        self.trainer_devices = 0 if self.spare_devices else self.trainer
        """The devices an added engine takes from (0: spare ones, ``EngineLending``)."""
        # From spare devices an engine receives the version as a broadcast to one and
        # loads it, and frees its memory when given back; from the trainer's, a refit.
        self.lend_s = (costs.transfer(1, config.weights.bucket_mb << 20) + costs.load()
                       if self.spare_devices else costs.reload())
        self.return_s = 0.0 if self.spare_devices else costs.release()
        first = config.rollout.num_workers
        self.engines = (first, first + count)
        self.standing = [engines[rank] for rank in range(first)]
        self.lendable = {rank: SimEngine(rank, costs, clock,
                                      drain=config.weights.update_mode == "drain",
                                      record_spans=False, kv_limit=kv_limit)
                      for rank in range(first, first + count)}
        engines.update(self.lendable)
        self.clients = {rank: client(rank, engine, self.least_busy)
                        for rank, engine in self.lendable.items()}
        self.pool: RolloutPool | None = None
        self.version: Callable[[], int] = lambda: 0
        """The trainer's policy version (a lent engine starts at it)."""
        self.queued: Callable[[], int] = lambda: 0
        """Groups in the replay queue now."""
        self._tasks: anyio.abc.TaskGroup | None = None
        self.lent: dict[int, float] = {}
        """Rank -> when its devices left the trainer."""
        self.lends = self.returns = self.engines_lent = 0
        self.device_s = self.switch_s = 0.0
        self._switched_at = -1.0
        self._moving = anyio.Event()
        self._moving.set()
        """Set while no starvation lend is under way."""
        self._last_start = self._last_end = self._waited = 0.0

    def start(self, attach: tuple[RolloutPool, Callable[[], int], Callable[[], int]],
              tasks: anyio.abc.TaskGroup) -> None:
        """In the run's event loop: the pool the engines join, the trainer's version and
        the queue's groups (``attach``), where lends run (``tasks``); every lendable
        engine starts off its devices."""
        self.pool, self.version, self.queued = attach
        self._tasks = tasks
        for engine in self.lendable.values():
            engine.release(0.0)

    def least_busy(self) -> SimEngine:
        """The standing engine an aborted request runs again on."""
        return min(self.standing, key=lambda engine: engine.pending)

    def compute_factor(self) -> float:
        """How many times a training step's compute takes: the trainer's devices over
        those it has left ("autopilot"; 1 otherwise)."""
        if self.arm != "autopilot" or not self.lent or self.spare_devices:
            return 1.0
        return self.trainer_devices / (self.trainer_devices
                                       - len(self.lent) * self.devices_per_engine)

    # ---- "autopilot": EngineLending -----------------------------------------------------

    async def add(self, rank: int) -> RolloutClient:
        self._switch(self.lend_s)
        self.lent[rank] = self.clock()
        self.engines_lent += 1
        self._take(rank)
        await anyio.sleep(self.lend_s)
        return self.clients[rank]

    async def remove(self, rank: int) -> None:
        self._switch(self.return_s, back=True)
        await self._give_back([rank])

    # ---- "starvation": the trainer's hooks ----------------------------------------------

    async def before_step(self) -> None:
        """A step's groups are in hand, before its first work on the trainer's devices:
        the share of the step the trainer waited is measured; "starvation": the lent
        devices come back (after a lend under way)."""
        now = self.clock()
        self._waited = (now - self._last_end) / max(now - self._last_start, 1e-9)
        self._last_start = now
        if self.arm == "starvation" and (self.lent or not self._moving.is_set()):
            await self._moving.wait()
            await self._give_back(sorted(self.lent))
            self.returns += 1
            self.switch_s += self.clock() - now

    def after_step(self) -> None:
        """The step's last work on the trainer's devices is done; "starvation": they are
        lent when the trainer starved and the queue cannot fill the next step."""
        self._last_end = self.clock()
        if (self.arm == "starvation" and self.lendable and self._tasks is not None
                and self._waited >= self.config.simulate.lend_wait
                and self.queued() < self.config.trainer.groups_per_step):
            self._moving = anyio.Event()
            self._tasks.start_soon(self._lend_all)

    async def _lend_all(self) -> None:
        assert self.pool is not None
        for rank in self.lendable:
            self.lent[rank] = self.clock()
            self._take(rank)
        self.lends += 1
        self.engines_lent += len(self.lendable)
        await anyio.sleep(self.lend_s)
        for rank in self.lendable:
            await self.pool.join(rank, self.clients[rank])
        self._moving.set()

    # ---- both ---------------------------------------------------------------------------

    def _take(self, rank: int) -> None:
        """``rank``'s engine takes its devices at the trainer's version (its engine sleeps
        ``lend_s``: a refit's reload, or from spare devices a version's broadcast)."""
        engine = self.lendable[rank]
        engine.version = self.version()
        engine.take_back(self.lend_s)

    async def _give_back(self, ranks: list[int]) -> None:
        """``ranks`` leave the pool (if there), their requests aborted, their devices
        released (``return_s``: a refit's release; nothing from spare devices)."""
        assert self.pool is not None
        live = self.pool.workers
        for rank in ranks:
            if rank in live:
                self.pool.leave(rank)
        releases = [self.lendable[rank].release(self.return_s, abort=True)
                    for rank in ranks]
        for release in releases:
            await release.done
        for rank in ranks:
            self.device_s += (self.clock() - self.lent.pop(rank)) * self.devices_per_engine

    def _switch(self, seconds: float, back: bool = False) -> None:
        """"autopilot": one move of engines (those at one instant) costs the trainer the
        switch's seconds once, the engines moving at once."""
        if self.clock() != self._switched_at:
            self._switched_at = self.clock()
            self.switch_s += seconds
            if back:
                self.returns += 1
            else:
                self.lends += 1

    def record(self) -> LendRecord:
        """sim.json's count of the lending, at the run's end."""
        now = self.clock()
        held = sum(now - since for since in self.lent.values()) * self.devices_per_engine
        return LendRecord(
            arm=self.arm, engines=len(self.lendable),
            devices_per_engine=self.devices_per_engine,
            trainer_devices=self.trainer, spare_devices=self.spare_devices, lends=self.lends,
            returns=self.returns, engines_lent=self.engines_lent,
            device_s=self.device_s + held, lend_s=self.lend_s, return_s=self.return_s,
            switch_s=self.switch_s,
            moved=sum(e.aborted for e in self.lendable.values()),
            moved_tokens=sum(e.aborted_tokens for e in self.lendable.values()))
