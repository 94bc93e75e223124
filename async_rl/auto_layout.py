"""``run.layout = "auto"``: measure, try shared, keep what was faster, say so.

Owns: the probe schedule after the warm-up steps and the measurements it takes (trainer
compute time from step results, rollout busy time from the workers). The two decision
rules themselves are ``workers.core_share.choose_layout`` and ``keep_shared``. Knows
nothing about the run's loops: the controller calls ``after_step`` once per step until
``choice`` is set.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from async_rl.records import ShardStepResult
from workers.core_share import AUTO_PROBE_STEPS, AUTO_WARMUP_STEPS, choose_layout, keep_shared


class AutoLayout:
    """Picks split or shared for one run; ``choice`` is "" while it is still measuring."""

    def __init__(self, rollout: dict[int, Any], trainers: Sequence[Any],
                 can_share: bool) -> None:
        self.choice = ""
        self._rollout, self._trainers, self._can_share = rollout, trainers, can_share
        self._probe: dict[str, float] = {}

    async def after_step(self, step: int, results: Sequence[ShardStepResult]) -> None:
        """Two probes of AUTO_PROBE_STEPS steps after the warm-up:

        1. split: training vs generation busy time (``choose_layout``); if training is
           not the bottleneck, stay split;
        2. else shared for as many steps: keep it only if its steps were faster
           (``keep_shared``). One line says what was picked and why.
        """
        now = time.perf_counter()
        probe = self._probe
        if step == AUTO_WARMUP_STEPS:
            probe.update(started=now, generate=await self._rollout_busy_s(), train=0.0)
            return
        if step < AUTO_WARMUP_STEPS:
            return
        probe["train"] += max(r.forward_s + r.backward_s + r.optimizer_s for r in results)
        if step == AUTO_WARMUP_STEPS + AUTO_PROBE_STEPS:
            generate_s = await self._rollout_busy_s() - probe["generate"]
            choice, why = choose_layout(probe["train"], generate_s)
            if choice == "shared" and not self._can_share:
                choice, why = "split", "no core sharing on GPUs"
            if choice == "split":
                self._pick("split", step, why)
                return
            probe.update(split_step_s=(now - probe["started"]) / AUTO_PROBE_STEPS,
                         shared_from=now)
            print(f"run.layout auto: {why}; trying shared for {AUTO_PROBE_STEPS} steps")
            await asyncio.gather(*(t.set_sharing.remote(True) for t in self._trainers))
        elif step == AUTO_WARMUP_STEPS + 2 * AUTO_PROBE_STEPS:
            shared_step_s = (now - probe["shared_from"]) / AUTO_PROBE_STEPS
            choice, why = keep_shared(probe["split_step_s"], shared_step_s)
            if choice == "split":
                await asyncio.gather(*(t.set_sharing.remote(False) for t in self._trainers))
            self._pick(choice, step, why)

    def _pick(self, choice: str, step: int, why: str) -> None:
        self.choice = choice
        print(f"run.layout auto -> {choice} after step {step}: {why}")

    async def _rollout_busy_s(self) -> float:
        """Mean busy seconds of the live rollout workers since they started."""
        workers = list(self._rollout.values())
        values = await asyncio.gather(*(w.busy_seconds.remote() for w in workers))
        return sum(values) / max(len(values), 1)
