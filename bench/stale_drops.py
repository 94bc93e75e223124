"""Stale drops by token length, without and with ``queue.wait_for_expiring``.

A simulation of the real ``ReplayQueue`` and ``AdmissionGate``, driven the way the
orchestrator drives them, by simulated rollout workers on a virtual clock (a run of
hundreds of steps takes about a second, the same every time for a seed):

- prompts are the long-tail task's (``async_rl.tasks.longtail``); each of a group's samples is
  as long as the prompt's reference completion (capped at 256 tokens, as
  ``examples/cpu_longtail.toml``), so most groups are short and a few are very long;
- a rollout worker is a continuously batching engine: every step emits one token per
  running sequence and costs ``step_s + per_sequence_s * running``; at most
  ``max_inflight`` groups run on it, so groups finish out of order, the longest last;
- the trainer takes ``groups_per_step`` groups, trains ``train_s + per_token_s * tokens``,
  publishes, and the new version is loaded into each engine in turn (an in-flight
  update pausing it for ``load_s``) before the gate opens for it;
- a dropped group's prompt is issued again first, as the orchestrator's ledger does.

The costs are calibrated on the long-tail run of this repository's 2-core machine: one
rollout worker at max_staleness 1 gives about 10 groups/s with the trainer waiting for
data about 70% of the time (the README's sweep measured 9.96 groups/s and 72%).

Before: ``wait_for_expiring=False`` (the take trains what is queued; a group that
arrives after its last chance is dropped). After: the default (the take also waits for
the groups still generating that it must hold). Per bucket of group tokens
(``queue.bucket_edges`` of the long-tail config): stale drops over groups generated.

    python bench/stale_drops.py
    python bench/stale_drops.py --workers 2,3 --staleness 1,2 --steps 200 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec

from async_rl.sim.clock import run_virtual
from async_rl.tasks.longtail import (
    MAX_NEW_TOKENS,
    RemainderTask,
    parse_prompt,
    reference_completion,
)
from buffers import AdmissionGate, Dropped, ReplayQueue

BUCKET_EDGES = (256, 512, 1024, 2048)
"""queue.bucket_edges of examples/cpu_longtail.toml (tokens per group)."""


class Costs(msgspec.Struct, frozen=True, kw_only=True):
    """The simulated machine (seconds); defaults calibrated as the module says."""

    step_s: float = 0.003
    per_sequence_s: float = 0.0001
    train_s: float = 0.05
    per_token_s: float = 60e-6
    publish_s: float = 0.05
    load_s: float = 0.03


class SimPrompt(msgspec.Struct, frozen=True, kw_only=True):
    prompt_id: str
    prompt_tokens: int
    completion_tokens: int
    """Of each sample: the reference completion's, plus EOS, at most 256."""


class SimGroup(msgspec.Struct, frozen=True, kw_only=True):
    """What the queue reads of a group (``buffers.QueueItem``), and its prompt."""

    prompt: SimPrompt
    min_version: int
    num_tokens: int

    @property
    def prompt_id(self) -> str:
        return self.prompt.prompt_id


class _Request:
    __slots__ = ("done", "left", "samples", "version")

    def __init__(self, length: int, samples: int) -> None:
        self.left, self.samples = length, samples
        self.done = anyio.Event()
        self.version = -1  # the engine's version at the group's first token


class Engine:
    """One simulated vLLM engine: continuous batching with in-flight weight updates."""

    def __init__(self, costs: Costs) -> None:
        self.costs = costs
        self.version = 0
        self._running: list[_Request] = []
        self._loads: list[tuple[int, anyio.Event]] = []
        self._wake = anyio.Event()

    async def run(self) -> None:
        while True:
            if self._loads:  # between two steps, as vLLM pauses
                await anyio.sleep(self.costs.load_s)
                for version, loaded in self._loads:
                    self.version = version
                    loaded.set()
                self._loads = []
            if not self._running:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            for request in self._running:
                if request.version < 0:
                    request.version = self.version
            sequences = sum(r.samples for r in self._running)
            await anyio.sleep(self.costs.step_s + self.costs.per_sequence_s * sequences)
            for request in self._running:
                request.left -= 1
            for request in [r for r in self._running if r.left <= 0]:
                self._running.remove(request)
                request.done.set()

    async def generate(self, length: int, samples: int) -> int:
        """Generates ``samples`` sequences of ``length`` tokens; returns the min version."""
        request = _Request(length, samples)
        self._running.append(request)
        self._wake.set()
        await request.done.wait()
        return request.version

    async def load(self, version: int) -> None:
        loaded = anyio.Event()
        self._loads.append((version, loaded))
        self._wake.set()
        await loaded.wait()


class Prompts:
    """The long-tail stream: a dropped prompt first, else the next new one."""

    def __init__(self, seed: int) -> None:
        self.task = RemainderTask(seed=seed)
        self.again: deque[SimPrompt] = deque()
        self.index = 0

    def next(self) -> SimPrompt:
        if self.again:
            return self.again.popleft()
        prompt = self.task.prompt_at(self.index)
        self.index += 1
        completion = len(reference_completion(*parse_prompt(prompt.text))) + 1
        return SimPrompt(prompt_id=prompt.prompt_id, prompt_tokens=len(prompt.text) + 1,
                         completion_tokens=min(completion, MAX_NEW_TOKENS))


async def simulate(*, workers: int, max_staleness: int, wait_for_expiring: bool,
                   steps: int, seed: int, costs: Costs, groups_per_step: int = 16,
                   group_size: int = 8, max_inflight: int = 16) -> dict[str, Any]:
    """One simulated run; the figures ``main`` prints."""
    clock = asyncio.get_running_loop()
    gate = AdmissionGate(groups_per_step=groups_per_step, max_staleness=max_staleness)
    prompts = Prompts(seed)

    def on_drop(dropped: Dropped[SimGroup]) -> None:
        gate.release()
        prompts.again.append(dropped.item.prompt)

    queue: ReplayQueue[SimGroup] = ReplayQueue(
        max_groups=64, max_tokens=1_000_000, max_staleness=max_staleness,
        bucket_edges=BUCKET_EDGES, on_drop=on_drop, wait_for_expiring=wait_for_expiring)
    engines = [Engine(costs) for _ in range(workers)]
    busy = [0] * workers
    free = anyio.Condition()

    async def generate(rank: int) -> None:
        prompt = prompts.next()
        with queue.expecting(gate.version):
            version = await engines[rank].generate(prompt.completion_tokens, group_size)
        tokens = group_size * (prompt.prompt_tokens + prompt.completion_tokens)
        await queue.put(SimGroup(prompt=prompt, min_version=version, num_tokens=tokens))
        async with free:
            busy[rank] -= 1
            free.notify_all()

    async def rollout() -> None:
        async with anyio.create_task_group() as generations:
            while True:
                await gate.acquire()
                async with free:
                    while min(busy) >= max_inflight:
                        await free.wait()
                    rank = busy.index(min(busy))
                    busy[rank] += 1
                generations.start_soon(generate, rank)

    async def deliver(version: int, previous: anyio.Event, done: anyio.Event) -> None:
        await previous.wait()
        for engine in engines:
            await engine.load(version)
        gate.on_version(version)
        done.set()

    version, waited, staleness = 0, 0.0, []
    async with anyio.create_task_group() as tg:
        for engine in engines:
            tg.start_soon(engine.run)
        tg.start_soon(rollout)
        delivered = anyio.Event()
        delivered.set()
        for _ in range(steps):
            started = clock.time()
            groups = await queue.take(groups_per_step, at_version=version)
            waited += clock.time() - started
            staleness += [version - g.min_version for g in groups]
            tokens = sum(g.num_tokens for g in groups)
            await anyio.sleep(costs.train_s + costs.per_token_s * tokens)
            version += 1
            await anyio.sleep(costs.publish_s)
            previous, delivered = delivered, anyio.Event()
            tg.start_soon(deliver, version, previous, delivered)
        wall = clock.time()
        tg.cancel_scope.cancel()
    buckets = queue.statistics().buckets
    return {"workers": workers, "max_staleness": max_staleness,
            "wait_for_expiring": wait_for_expiring,
            "buckets": [{"low": b.low, "high": b.high, "generated": b.put_total,
                         "dropped": b.dropped} for b in buckets],
            "generated": sum(b.put_total for b in buckets),
            "dropped": sum(b.dropped for b in buckets),
            "groups_per_s": steps * groups_per_step / wall,
            "mean_staleness": statistics.fmean(staleness),
            "trainer_wait": waited / wall}


def run(**kwargs: Any) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        return await simulate(**kwargs)

    return run_virtual(main)


def _rate(dropped: int, generated: int) -> str:
    share = f"{100 * dropped / generated:.1f}%" if generated else "-"
    return f"{dropped}/{generated} ({share})"


def _label(bucket: dict[str, Any]) -> str:
    if bucket["high"] is None:
        return f">={bucket['low']}"
    return f"<{bucket['high']}" if bucket["low"] == 0 else f"{bucket['low']}-{bucket['high'] - 1}"


def table(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    """Markdown: per setting and bucket, stale drops / groups generated, before | after."""
    lines = ["| workers | max_staleness | group tokens | before: dropped/generated "
             "| after: dropped/generated |", "| --- | --- | --- | --- | --- |"]
    for before, after in pairs:
        head = f"| {before['workers']} | {before['max_staleness']} "
        for b, a in zip(before["buckets"], after["buckets"], strict=True):
            lines.append(f"{head}| {_label(b)} | {_rate(b['dropped'], b['generated'])} "
                         f"| {_rate(a['dropped'], a['generated'])} |")
        lines.append(f"{head}| all | {_rate(before['dropped'], before['generated'])} "
                     f"| {_rate(after['dropped'], after['generated'])} |")
        lines.append(
            f"{head}| groups/s, mean staleness, trainer wait "
            f"| {before['groups_per_s']:.1f}, {before['mean_staleness']:.2f}, "
            f"{before['trainer_wait']:.0%} | {after['groups_per_s']:.1f}, "
            f"{after['mean_staleness']:.2f}, {after['trainer_wait']:.0%} |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--workers", type=_ints, default=[1, 2, 3])
    parser.add_argument("--staleness", type=_ints, default=[1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    settings = [(w, s) for w in args.workers for s in args.staleness]
    pairs = [(run(workers=w, max_staleness=s, wait_for_expiring=False, steps=args.steps,
                  seed=args.seed, costs=Costs()),
              run(workers=w, max_staleness=s, wait_for_expiring=True, steps=args.steps,
                  seed=args.seed, costs=Costs())) for w, s in settings]
    if args.json:
        print(json.dumps({"steps": args.steps, "seed": args.seed,
                          "runs": [run for pair in pairs for run in pair]}))
    else:
        print(f"{args.steps} simulated steps of 16 groups x 8 samples, long-tail lengths, "
              f"seed {args.seed}; before: queue.wait_for_expiring = false, after: true")
        print(table(pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
