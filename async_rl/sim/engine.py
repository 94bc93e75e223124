"""A simulated continuously batching engine (vLLM's scheduling, the cost model's time).

Owns: ``SimEngine``, one rollout worker's engine on the virtual clock (what it is
asked, requests and loads: ``async_rl.sim.engine_calls``). Requests join at
the next step boundary (their prefill adds to that step), every step emits one token per
running sequence and costs ``Costs.decode_step`` of the running sequences and their
context, a sequence leaves after its length, a request completes with its last
sequence. A weight update pauses the engine at a step boundary (in-flight: requests kept;
drain: once the running ones finish), waits there for the group's collective to begin
(``weight_sync``), receives (``weight_wire``) and loads (``weight_load``), and every
token after it carries the new version.
The engine wakes only when a request completes, one arrives or a load is asked for:
between those, time is summed in closed form (``Costs.decode_steps``) over the stretches
between sequences' ends, so a run costs events per request, not per token. Spans as a
real rollout worker records them (generate, evaluate, weight_sync, idle). A trainer shard
busy on the engine's cores slows its steps (``slow_down``). With a KV-cache bound
(``kv_limit`` tokens), a request joins only while the running sequences' reservations
(its prompt, and each sequence's full length: no preemption is modelled) leave room for
its own; the others wait in the engine's queue, first come first served, and the engine
counts how many waited and how long (``kv_queued``, ``kv_wait_s``). Time-shared
devices (run.colocate = "time"): ``release`` stops the engine at a step boundary and
frees its devices (``Costs.release``) until ``take_back`` (then it reloads:
``Costs.reload``), its requests kept; a derived reload also recomputes the KV cache of
the sequences it kept (a prefill of their context: the sleep freed it). Lent devices
(simulate.lend) release with ``abort``: every request ends unfinished (``Request.made``:
each sequence's tokens so far; counted in ``aborted_tokens``), and loads asked take
effect at once. A sequence of a
model with linear-attention layers reserves its fixed state too (``Costs.state_tokens``).
Knows nothing about prompts, groups or the orchestrator.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import heapq
import itertools
import math
from collections.abc import Callable

from async_rl.sim.costs import Costs
from async_rl.sim.engine_calls import Load, Request, settle
from workers.common.spans import UNRESOLVED, Span, SpanRecorder


class SimEngine:
    """See the module docstring. ``drain``: weights.update_mode = "drain"."""

    def __init__(self, rank: int, costs: Costs, clock: Callable[[], float], *,
                 version: int = 0, drain: bool = False, record_spans: bool = True,
                 kv_limit: float | None = None) -> None:
        self.costs, self.clock, self.drain = costs, clock, drain
        self.version = version
        self.kv_limit = kv_limit
        """Tokens of KV cache (None: not bounded)."""
        self.kv_reserved = 0.0
        self.kv_peak = 0.0
        self.requests = 0
        self.kv_queued = 0
        self.kv_wait_s = 0.0
        self.releases = self.aborted = self.aborted_tokens = 0
        self.recompute_s = 0.0
        """Seconds spent recomputing the KV cache a release freed."""
        self._release: Load | None = None
        self._abort = False
        self._reload_s: float | None = None
        """What the next reload costs when not ``Costs.reload`` (``take_back``)."""
        """A release asked for: the engine stops at its next step boundary."""
        self._back: asyncio.Future[None] | None = None
        """Settled by ``take_back``."""
        self.busy_s = 0.0
        """Seconds generating or loading weights (the usage the CPU cross-check reads)."""
        self.spans = SpanRecorder(worker=f"rollout-{rank}", role="rollout", rank=rank,
                                  device=f"sim:{rank}", clock=clock, enabled=record_spans)
        self.step = 0
        self._stretch: tuple[float, float] | None = None
        """While decoding towards an event: when the stretch began, its prefill's s."""
        self._waiting: list[Request] = []
        self._loads: list[Load] = []
        self._ends: list[tuple[int, int, float]] = []
        """(step a sequence ends at, its context offset = prompt tokens - step it joined,
        the KV-cache tokens it reserved), sorted."""
        self._requests: list[tuple[int, int, Request]] = []
        """Heap of (step the request completes at, order, request)."""
        self._order = itertools.count()
        self._running = 0
        self._evaluating = 0
        self._offset = 0
        """Context of the running sequences = _offset + _running * step."""
        self._prefill = 0.0
        self._slowdown = self._next_slowdown = 1.0
        """Every step takes this many times its cost (a trainer shard busy on this
        engine's cores); a change takes effect at the next step boundary."""
        self._woken: asyncio.Future[bool] | None = None
        """What the engine waits on: a timer or ``_wake`` settles it (asyncio's own, the
        cheapest wait there is: the simulation runs on asyncio's loop)."""

    # ---- what the rollout worker asks ---------------------------------------------------

    async def generate(self, prompt_tokens: int, lengths: tuple[int, ...], *,
                       evaluate: bool = False, after: float = 0.0) -> Request:
        """Runs the sequences; returns their request ``after`` seconds past the end of
        the last (one timer instead of a sleep of the caller's: a task step less)."""
        request = self.submit(prompt_tokens, lengths, evaluate=evaluate, after=after)
        await request.done
        return request

    def submit(self, prompt_tokens: int, lengths: tuple[int, ...], *,
               evaluate: bool = False, after: float = 0.0) -> Request:
        """``generate`` without the wait: the request, its ``done`` settled later."""
        request = Request(prompt_tokens, lengths, evaluate, after, self.clock())
        self._waiting.append(request)
        self._wake()
        return request

    def step_now(self) -> int:
        """The last step boundary passed at this instant (mid-stretch too: the engine
        sums a stretch's steps only when it wakes)."""
        if self._stretch is None:
            return self.step
        began, prefill = self._stretch
        budget = self.clock() - began - prefill
        if budget <= 0 or not self._requests:
            return self.step
        step, seconds = self._walk(self._requests[0][0], budget)
        return step if seconds <= budget else step - 1

    def load(self, version: int, wire_s: float, load_s: float,
             start: asyncio.Future[None] | None = None) -> Load:
        """Asks for a pause at the next step boundary (drain: once nothing runs): after
        ``start`` is settled (None: at once), ``wire_s`` of bytes arriving and ``load_s``
        of loading them, after which the engine runs ``version``; ``Load.paused`` is set
        at the pause, ``Load.done`` at its end."""
        load = Load(version, wire_s, load_s, self.clock(), start)
        self._loads.append(load)
        self._wake()
        return load

    def release(self, pause_s: float, *, abort: bool = False) -> Load:
        """Asks the engine to free its devices at the next step boundary, after
        ``pause_s`` of releasing them (``Load.done`` then); it stays off them until
        ``take_back``. ``abort``: its requests end there unfinished."""
        self._release = Load(self.version, 0.0, pause_s, self.clock())
        self._abort = abort
        self._back = asyncio.get_running_loop().create_future()
        self._wake()
        return self._release

    def take_back(self, reload_s: float | None = None) -> None:
        """The devices are the engine's again: it reloads (``Costs.reload``, or
        ``reload_s``) and goes on."""
        assert self._back is not None
        self._reload_s = reload_s
        settle(self._back)

    def slow_down(self, factor: float) -> None:
        """From the next step boundary on, steps take ``factor`` times their cost."""
        if factor != self._next_slowdown:
            self._next_slowdown = factor
            self._wake()

    @property
    def busy(self) -> bool:
        """Sequences are running (or a weight load holds the engine)."""
        return bool(self._requests or self._loads)

    @property
    def pending(self) -> int:
        """Requests running or waiting to join."""
        return len(self._requests) + len(self._waiting)

    @property
    def kv_waiting(self) -> bool:
        """Requests wait in the queue for KV-cache room."""
        return bool(self._waiting) and self.kv_limit is not None

    def drain_spans(self) -> list[Span]:
        return self.spans.flush()

    # ---- the engine loop ----------------------------------------------------------------

    async def run(self) -> None:
        while True:
            self._slowdown = self._next_slowdown
            if self._release is not None:
                await self._released()
            if self._loads and not (self.drain and self._requests):
                await self._apply_loads()
            if not (self._loads and self.drain):
                self._admit()
            if not self._requests:
                self._switch()
                await self._sleep(None)
                continue
            self._switch()
            target = self._requests[0][0]
            if self._waiting and self._ends:  # KV room frees as sequences end
                target = min(target, self._ends[0][0])
            planned = self._prefill + self._time_to(target)
            began = self.clock()
            self._stretch = (began, self._prefill)
            if await self._sleep(planned):  # woken: the step in progress ends first
                elapsed = self.clock() - began
                target = self._steps_within(elapsed - self._prefill)
                await asyncio.sleep(max(self._prefill + self._time_to(target) - elapsed, 0.0))
            self.busy_s += self.clock() - began
            self._prefill, self._stretch = 0.0, None
            self._advance(target)

    def _wake(self) -> None:
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(True)

    async def _sleep(self, seconds: float | None) -> bool:
        """Sleeps ``seconds`` (None: until woken); True if ``_wake`` ended it early."""
        loop = asyncio.get_running_loop()
        self._woken = woken = loop.create_future()

        def expire() -> None:
            if not woken.done():
                woken.set_result(False)

        timer = None if seconds is None else loop.call_later(seconds, expire)
        try:
            return await woken
        finally:
            self._woken = None
            if timer is not None:
                timer.cancel()

    def _switch(self) -> None:
        if self._running > self._evaluating:
            self.spans.switch("generate", self.version)
        else:
            self.spans.switch("evaluate" if self._running else UNRESOLVED, self.version)

    async def _released(self) -> None:
        """Off the devices from a release until ``take_back``, then the reload."""
        release, self._release = self._release, None
        assert release is not None and self._back is not None
        self.releases += 1
        if self._abort:
            self._end_requests()
        self.spans.switch("weight_sync", self.version)
        await asyncio.sleep(release.pause_s)
        release.done_at = self.clock()
        settle(release.done)
        self.spans.switch(UNRESOLVED, self.version)  # the trainer has the devices
        await self._back
        self.spans.switch("weight_sync", self.version)
        reload = self.costs.reload() if self._reload_s is None else self._reload_s
        if self.costs.refit.derived and self._running:  # the KV cache the sleep freed
            recompute = self.costs.prefill(self._offset + self._running * self.step)
            self.recompute_s += recompute
            reload += recompute
        await asyncio.sleep(reload)
        self.busy_s += release.pause_s + reload

    def _end_requests(self) -> None:
        """Every request ends unfinished (see the module docstring); the engine is empty."""
        for _, _, request in self._requests:
            joined = request.finish - max(request.lengths)
            request.made = tuple(min(n, self.step - joined) for n in request.lengths)
            self.aborted_tokens += sum(request.made)
        for request in [r for *_, r in self._requests] + self._waiting:
            request.made = request.made or (0,) * len(request.lengths)
            self.aborted += 1
            settle(request.done)
        self._requests.clear()
        self._waiting.clear()
        self._ends.clear()
        self._running = self._evaluating = self._offset = 0
        self.kv_reserved = self._prefill = 0.0
        for load in self._loads:  # out of the group: a collective does not wait for it
            self.version = load.version
            settle(load.paused)
            settle(load.done)
        self._loads.clear()

    async def _apply_loads(self) -> None:
        """Each load asked, in order: paused, waiting on the group (``weight_sync``), the
        bytes arriving (``weight_wire``), then loading them (``weight_load``), as a real
        engine's spans split its pause."""
        loads, self._loads = self._loads, []
        began = self.clock()
        for load in loads:
            self.spans.switch("weight_sync", self.version)
            load.paused_at = self.clock()
            settle(load.paused)
            if load.start is not None:
                await load.start
            for phase, seconds in (("weight_wire", load.wire_s), ("weight_load", load.load_s)):
                if seconds > 0:
                    self.spans.switch(phase, self.version)
                    await asyncio.sleep(seconds)
            self.version = load.version
            load.done_at = self.clock()
            settle(load.done)
        self.busy_s += self.clock() - began

    def _admit(self) -> None:
        admitted = 0
        for request in self._waiting:
            state = self.costs.state_tokens  # a linear-attention sequence's fixed state
            need = request.prompt_tokens + sum(request.lengths) + state * len(request.lengths)
            if (self.kv_limit is not None and self.kv_reserved + need > self.kv_limit
                    and self._running):  # alone, it runs whatever its size
                request.queued = True
                break
            admitted += 1
            self.requests += 1
            if request.queued:
                self.kv_queued += 1
                self.kv_wait_s += self.clock() - request.arrived
            self.kv_reserved += need
            self.kv_peak = max(self.kv_peak, self.kv_reserved)
            request.min_version = self.version
            request.finish = self.step + max(request.lengths)
            offset = request.prompt_tokens - self.step
            share = request.prompt_tokens / len(request.lengths)
            for length in request.lengths:
                bisect.insort(self._ends, (self.step + length, offset,
                                           length + share + state))
            self._running += len(request.lengths)
            self._evaluating += len(request.lengths) if request.evaluate else 0
            self._offset += offset * len(request.lengths)
            self._prefill += self._slowdown * self.costs.prefill(
                request.prompt_tokens * len(request.lengths))
            heapq.heappush(self._requests, (request.finish, next(self._order), request))
        del self._waiting[:admitted]

    def _time_to(self, target: int) -> float:
        """Seconds of the decode steps from now to step ``target``."""
        return self._walk(target, math.inf)[1]

    def _steps_within(self, seconds: float) -> int:
        """The first step boundary at or after ``seconds`` of decoding from now."""
        return self._walk(self._requests[0][0], seconds)[0]

    def _walk(self, target: int, budget: float) -> tuple[int, float]:
        """Decodes from now towards step ``target``, stretch by stretch between
        sequences' ends, until the first step boundary at or past ``budget`` seconds;
        returns that step (or ``target``) and its seconds."""
        seconds, step, running, offset = 0.0, self.step, self._running, self._offset
        if budget <= 0:  # still in the prefill: the next step starts after it
            return step, seconds
        cost = self.costs.decode_steps
        if self._slowdown != 1.0:
            cost = functools.partial(_slowed, self._slowdown, cost)
        i, ends = 0, self._ends
        while step < target:
            while i < len(ends) and ends[i][0] <= step:  # ended: out of the batch
                running -= 1
                offset -= ends[i][1]
                i += 1
            stop = min(ends[i][0], target) if i < len(ends) else target
            stretch = cost(stop - step, running, offset + running * step)
            if seconds + stretch >= budget:  # inside this stretch: its first step past
                low, high = 1, stop - step
                while low < high:
                    mid = (low + high) // 2
                    if seconds + cost(mid, running, offset + running * step) >= budget:
                        high = mid
                    else:
                        low = mid + 1
                return step + low, seconds + cost(low, running, offset + running * step)
            seconds += stretch
            step = stop
        return step, seconds

    def _advance(self, step: int) -> None:
        ended = bisect.bisect_right(self._ends, (step, math.inf))
        for _, offset, reserved in self._ends[:ended]:
            self._offset -= offset
            self.kv_reserved -= reserved
        self._running -= ended
        del self._ends[:ended]
        self.step = step
        while self._requests and self._requests[0][0] <= step:
            request = heapq.heappop(self._requests)[2]
            if request.evaluate:
                self._evaluating -= len(request.lengths)
            request.max_version = self.version
            if request.after > 0:
                asyncio.get_running_loop().call_later(request.after, settle, request.done)
            else:
                settle(request.done)


def _slowed(factor: float, cost: Callable[[int, int, float], float], steps: int,
            running: int, context: float) -> float:
    return factor * cost(steps, running, context)
