"""The simulated trainer shards behind the orchestrator's protocols
(``async_rl.control.protocols``).

Owns: ``SimTraining`` and its ``SimTrainer`` shards (``TrainerClient``: a step costs what
the plan the orchestrator made says, micro-batch by micro-batch, every update waiting
for the slowest shard before its all-reduce, as DDP does; on a CPU machine laid out as
a real run, busy engines slow a step, and one on a shard's cores takes turns with it),
the shards' calls met together (``SimTraining.together``) and work of other roles on
their devices (``beside_step``: ``async_rl.sim.roles``'s passes). Every span and timing
is on the virtual clock. With run.colocate = "time", every engine releases its devices
for each training step (``async_rl.sim.timeshare``); with simulate.lend, the lending is
told of each step's start and end, and slows its compute by what it lent
(``async_rl.sim.lending``). The rollout side is
``async_rl.sim.rollout``'s. Knows nothing about the orchestrator's rules: they are the
real ones.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec

from async_rl.config import Config
from async_rl.roster import roster
from async_rl.sim.costs import Costs
from async_rl.sim.engine import SimEngine
from async_rl.sim.lending import SimLending
from async_rl.sim.rollout import Clock, SimTokens
from buffers.common.reports import UsageReading
from buffers.common.train_records import LossStats, ShardBatch, ShardStepResult
from workers.common.spans import UNRESOLVED, Span, SpanRecorder

CONTENTION_SLICES = 8
"""A step beside engines on its machine is run in this many slices, each as slowed as
the engines busy as it starts make it."""


def policy_pass(config: Config) -> bool:
    """The PPO stages run a no-grad forward of the policy before its update: its
    logprobs are the KL in the reward's (trainer.kl_in_reward)."""
    return config.trainer.kl_in_reward and config.has_reference


def proximal_pass(config: Config, updates: int) -> bool:
    """The policy's update of ``updates`` optimizer updates (every epoch's) makes the
    proximal pass, as the real shard does (``StepLoss.needs_proximal``: several updates,
    or LoRA dropout), unless ``policy_pass`` made it already; simulate.old_logprob_pass
    "always" or "never" says otherwise (a framework's old log-prob pass)."""
    cfg = config.trainer
    lora = config.model.lora
    if policy_pass(config):
        return False
    if config.simulate.old_logprob_pass != "trainer":  # "always" (verl, NeMo RL) or "never"
        return config.simulate.old_logprob_pass == "always"
    return cfg.tis_cap > 0 and (updates > 1 or (lora.enabled and lora.dropout > 0))


class _Cursor:
    """A clock a span recorder reads that the trainer moves: spans at computed times."""

    def __init__(self) -> None:
        self.at = 0.0

    def __call__(self) -> float:
        return self.at


class SimTraining:
    """The trainer shards of one run, stepping together: see the module docstring."""

    def __init__(self, config: Config, costs: Costs, clock: Clock,
                 engines: dict[int, SimEngine], lending: SimLending | None = None) -> None:
        self.config, self.costs, self.clock, self.engines = config, costs, clock, engines
        self.lending = lending
        self.shards = config.trainer.num_shards
        self.time_shared = config.run.colocate == "time"
        """Engines release their devices for every step (run.colocate = "time")."""
        self._released = False
        self.sharing = engines_on_trainer_cores(config, costs.hardware.cores)
        """Per shard, the ranks of the engines on its cores (empty list: no CPU machine
        laid out, no contention)."""
        self._arrived: dict[int, Any] = {}
        self._results: dict[int, Any] = {}
        self._done = anyio.Event()
        self.cursor = _Cursor()
        self.busy_s = [0.0] * self.shards
        self.recorders = [SpanRecorder(worker=f"trainer-{r}", role="trainer", rank=r,
                                       device=f"sim:{r}", clock=self.cursor,
                                       enabled=config.run.record_spans)
                          for r in range(self.shards)]
        self.waiting: list[SpanRecorder] = []
        """Per shard, the track of a role co-located on its devices that waits while the
        policy trains (the critic's: its cause ``policy``); empty without one."""

    async def together(self, rank: int, payload: Any,
                       run: Callable[[list[Any]], Awaitable[list[Any]]]) -> Any:
        """Every shard calls with its ``payload``; once all have, ``run`` gets them in rank
        order and returns each shard's result (the orchestrator awaits every shard's
        call before its next, so calls of two kinds never interleave)."""
        self._arrived[rank] = payload
        done = self._done
        if len(self._arrived) < self.shards:
            await done.wait()
        else:
            arrived, self._arrived = self._arrived, {}
            self._done = anyio.Event()
            self._results = dict(enumerate(await run([arrived[r]
                                                      for r in range(self.shards)])))
            done.set()
        return self._results.pop(rank)

    async def train(self, rank: int, batch: ShardBatch) -> ShardStepResult:
        """Every shard calls with its batch; the step runs once all have."""
        result: ShardStepResult = await self.together(rank, batch, self._train)
        return result

    async def _train(self, ordered: list[ShardBatch]) -> list[ShardStepResult]:
        await self.release_devices()
        compute = self._compute(ordered)
        began = self.clock()
        slowdowns = await self._slowdowns(self._solo_seconds(ordered[0], compute))
        seconds, results = self._step(ordered, compute, slowdowns, start=began)
        await anyio.sleep(max(began + seconds - self.clock(), 0.0))
        if not self.waiting:  # else the critic's update ends the step on the devices
            self.return_devices()
        return results

    async def release_devices(self) -> None:
        """Before the step's first work on the devices (the roles' passes, or the policy's
        update): the lending is told (lent devices come back); run.colocate = "time":
        the engines free the devices at a step boundary. A no-op the second time."""
        if self._released:
            return
        self._released = True
        if self.lending is not None:
            await self.lending.before_step()
        if self.time_shared:
            releases = [engine.release(self.costs.release())
                        for engine in self.engines.values()]
            for release in releases:
                await release.done

    def return_devices(self) -> None:
        """The step's last work on the devices is done: the engines take them back."""
        if self._released:
            self._released = False
            if self.lending is not None:
                self.lending.after_step()
            for engine in self.engines.values() if self.time_shared else ():
                engine.take_back()

    async def beside_step(self, work: Sequence[float],
                          tracks: Sequence[tuple[Sequence[SpanRecorder], str]]) -> list[float]:
        """A stage of the PPO dataflow on every shard's devices (placement "trainer"):
        after the call, each shard computes its ``work`` seconds (slowed as a step is
        beside busy engines), recorded as each of ``tracks``' cause (its recorders, by
        shard); the stage ends with the slowest shard. Returns each shard's seconds."""
        began = self.clock()
        start = began + self.costs.hardware.call_s
        slowdowns = await self._slowdowns(self.costs.hardware.call_s + max(work))
        seconds = [slow * w for slow, w in zip(slowdowns, work, strict=True)]
        for rank, spent in enumerate(seconds):
            for recorders, cause in tracks:
                for at, now in ((start, cause), (start + spent, UNRESOLVED)):
                    self.cursor.at = at
                    recorders[rank].switch(now)
            self.busy_s[rank] += spent
        self.cursor.at = start + max(seconds)
        await anyio.sleep(max(start + max(seconds) - self.clock(), 0.0))
        return seconds

    async def _slowdowns(self, solo: float) -> list[float]:
        """Each shard's compute slowdown over ``solo`` seconds of work (1 without a CPU
        machine laid out, else waits out the contended slices; times the devices lent's
        ``compute_factor``)."""
        lent = self.lending.compute_factor() if self.lending is not None else 1.0
        if not self.sharing:
            return [lent] * self.shards
        return [lent * slow for slow in await self._contended(solo)]

    async def _contended(self, solo: float) -> list[float]:
        """Runs a step of ``solo`` seconds on a machine the engines share, in
        ``CONTENTION_SLICES`` slices, each slowed by the engines busy as it starts
        (those on a shard's cores take turns with it: their steps slow too); returns
        each shard's mean slowdown."""
        slices = CONTENTION_SLICES
        total = [0.0] * self.shards
        self._share_cores(trainers_busy=True)
        for _ in range(slices):
            busy = {rank for rank, engine in self.engines.items() if engine.busy}
            slowdowns = [self.costs.train_slowdown(len(busy & shared), len(busy - shared))
                         for shared in self.sharing]
            total = [t + s for t, s in zip(total, slowdowns, strict=True)]
            await anyio.sleep(solo / slices * max(slowdowns))
        self._share_cores(trainers_busy=False)
        return [t / slices for t in total]

    def _share_cores(self, *, trainers_busy: bool) -> None:
        for rank, engine in self.engines.items():
            shards = sum(rank in shared for shared in self.sharing) if trainers_busy else 0
            engine.slow_down(self.costs.engine_slowdown(shards))

    def _compute(self, batches: list[ShardBatch]) -> list[list[float]]:
        """Per shard, each micro-batch's forward and backward seconds (costed once a step:
        the updates, the proximal pass and the contention estimate all read them)."""
        return [[self.costs.micro_batch(mb) for mb in sim_sequences(batch)]
                for batch in batches]

    def _solo_seconds(self, batch: ShardBatch, compute: list[list[float]]) -> float:
        """About the step's seconds with nothing beside it (what its slices divide): the
        slowest shard's compute (and its proximal pass), every update's fixed part, the
        call."""
        cfg, costs = self.config.trainer, self.costs
        updates = len(batch.updates) * cfg.epochs
        proximal = 4 / 3 if proximal_pass(self.config, updates) else 1.0
        slowest = max(sum(per) for per in compute)
        per_update = max(len(per) for per in compute) / max(updates // cfg.epochs, 1)
        bubble = costs.pipeline_bubble(round(per_update))
        return (costs.hardware.call_s + bubble * slowest * (cfg.epochs + proximal - 1)
                + updates * costs.update(self.shards))

    def _step(self, batches: list[ShardBatch], compute: list[list[float]],
              slowdowns: list[float], *, start: float
              ) -> tuple[float, list[ShardStepResult]]:
        """Lays out every shard's spans of the step from ``start`` (its compute
        ``slowdowns`` times its cost; ``compute``: ``_compute(batches)``); returns its
        seconds and every shard's result."""
        cfg, costs = self.config.trainer, self.costs
        updates = batches[0].updates
        proximal = proximal_pass(self.config, len(updates) * cfg.epochs)
        began = start
        start += costs.hardware.call_s
        now = start
        self.cursor.at = start
        for waiting in self.waiting:
            waiting.switch("policy")  # a co-located critic waits on the device
        forward = [0.0] * self.shards
        backward = [0.0] * self.shards
        waited = [0.0] * self.shards
        # The proximal pass: one more forward over the step.
        # A pipeline's fill and drain (pp > 1): per pass over a batch of micro-batches.
        bubble = costs.pipeline_bubble
        extra = ([slow * sum(per) / 3 * bubble(len(per))
                  for slow, per in zip(slowdowns, compute, strict=True)] if proximal
                 else [0.0] * self.shards)
        for _ in range(cfg.epochs):
            first = 0
            for count in updates:
                work = [slow * sum(per[first:first + count]) * bubble(count)
                        for slow, per in zip(slowdowns, compute, strict=True)]
                first += count
                now = self._update(now, work, extra, forward, backward, waited)
                extra = [0.0] * self.shards
        self.cursor.at = now
        step = batches[0].step
        for waiting in self.waiting:
            waiting.switch(UNRESOLVED)
        results = []
        for rank, (recorder, batch) in enumerate(zip(self.recorders, batches, strict=True)):
            recorder.switch(UNRESOLVED, step)
            completion = sum(map(sum, sim_sequences(batch, completion=True)))
            real = sum(map(sum, sim_sequences(batch)))
            self.busy_s[rank] += now - start - waited[rank]
            results.append(ShardStepResult(
                rank=rank, step=step, grad_norm=1.0,
                loss=LossStats(tokens=completion, loss_sum=0.0, clipped=0,
                               is_weight_sum=float(completion),
                               is_weight_sq_sum=float(completion), is_weight_max=1.0,
                               kl_sum=0.0),
                forward_s=forward[rank], backward_s=backward[rank],
                optimizer_s=len(updates) * cfg.epochs * costs.update(self.shards),
                barrier_s=waited[rank], input_tokens=real, computed_positions=real))
        return now - began, results

    def _update(self, now: float, work: list[float], extra: list[float],
                forward: list[float], backward: list[float], waited: list[float]) -> float:
        """One optimizer update from ``now``: each shard's forward (a third of ``work``,
        plus ``extra``) and backward, the quick ones waiting for the slowest before the
        all-reduce, then the optimizer. Returns when it ends."""
        total = [w + e for w, e in zip(work, extra, strict=True)]
        slowest = max(total)
        for rank, recorder in enumerate(self.recorders):
            ahead = work[rank] / 3 + extra[rank]
            for cause, at in (("forward", now), ("backward", now + ahead),
                              ("barrier", now + total[rank])):
                self.cursor.at = at
                recorder.switch(cause)
            forward[rank] += ahead
            backward[rank] += total[rank] - ahead
            waited[rank] += slowest - total[rank]
        self.cursor.at = now + slowest
        for recorder in self.recorders:
            recorder.switch("optimizer")
        return now + slowest + self.costs.update(self.shards)


def engines_on_trainer_cores(config: Config, cores: int) -> list[frozenset[int]]:
    """Per trainer shard, the engines a real run on ``cores`` cores would give some of its
    cores (none laid out: ``cores`` 0)."""
    if not cores:
        return []
    layout = roster(config, available=tuple(range(cores))).layout
    return [frozenset(engine.rank for engine in layout.rollout
                      if set(engine.devices) & set(shard.devices))
            for shard in layout.trainer]


def sim_sequences(batch: ShardBatch, *, completion: bool = False) -> list[list[int]]:
    """Each micro-batch's sequence lengths (``completion``: their completions' alone)."""
    return [[_sequence(batch, slot, completion=completion) for slot in mb]
            for mb in batch.micro_batches]


def _sequence(batch: ShardBatch, slot: object, *, completion: bool = False) -> int:
    tokens = batch.groups[slot.group]  # type: ignore[attr-defined]
    assert isinstance(tokens, SimTokens)
    length = tokens.completion_lengths[slot.sample]  # type: ignore[attr-defined]
    return length if completion else tokens.prompt_length + length


class SimPolicyWeights(msgspec.Struct, frozen=True, kw_only=True):
    version: int


class SimTrainer:
    """One trainer shard: its share of ``SimTraining``'s steps."""

    def __init__(self, rank: int, training: SimTraining) -> None:
        self.rank, self.training = rank, training

    @property
    def name(self) -> str:
        return f"trainer-{self.rank}"

    async def train(self, batch: ShardBatch) -> ShardStepResult:
        return await self.training.train(self.rank, batch)

    async def mean_cores(self) -> float:
        return 1.0

    async def policy_weights(self, version: int) -> SimPolicyWeights:
        return SimPolicyWeights(version=version)

    async def save(self, out_dir: str) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)

    async def save_policy(self, out_dir: str) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)

    async def save_checkpoint(self, out_dir: str) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)

    async def checkpoint_written(self) -> None:
        """Simulated checkpoints are written at once (they cost nothing)."""

    async def usage(self) -> UsageReading:
        return UsageReading(wall=self.training.clock(), cpu_s=self.training.busy_s[self.rank])

    async def spans(self) -> list[Span]:
        training = self.training
        training.cursor.at = training.clock()
        beside = training.waiting[self.rank].flush() if training.waiting else []
        return training.recorders[self.rank].flush() + beside
