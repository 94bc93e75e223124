"""``run.layout = "auto"``: measure, try shared, keep what was faster, say so.

Owns: the probe schedule after the warm-up steps, the measurements it takes (trainer
compute time from step results, rollout busy time from the workers) and the two pure
decision rules, ``choose_layout`` and ``keep_shared``. Knows nothing about the run's
loops (the orchestrator calls ``after_step`` once per step until ``choice`` is set) nor
how a trainer borrows cores (``workers.core_share``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Literal

import anyio

from async_rl.control.protocols import RolloutClient, TrainerClient
from buffers.records import ShardStepResult

AUTO_WARMUP_STEPS = 1
"""Steps "auto" skips before measuring (the first one waits for the first data)."""
AUTO_PROBE_STEPS = 3
"""Steps "auto" measures (after the warm-up) before it picks a layout."""
AUTO_MARGIN = 1.2
"""Shared is tried only when training costs this many times what generating costs."""


def choose_layout(train_s: float, generate_s: float,
                  margin: float = AUTO_MARGIN) -> tuple[Literal["split", "shared"], str]:
    """Split or shared from the stage costs over the same steps; (choice, why).

    ``train_s``: the trainer's busy seconds (forward + backward + optimizer) over the
    probe steps; ``generate_s``: a rollout worker's busy seconds (requests in flight or a
    weight load) over the same wall window, mean over workers. Shared pays off only when
    the trainer is the slower stage: then the rollout worker idles at the staleness gate
    and its core is free part of the time.
    """
    ratio = train_s / generate_s if generate_s > 0 else float("inf")
    if ratio >= margin:
        return "shared", (f"training is the bottleneck (train {train_s:.2f}s vs generate "
                          f"{generate_s:.2f}s, {ratio:.2f}x >= {margin}): the trainer "
                          "borrows the rollout cores while they idle")
    return "split", (f"training is not the bottleneck (train {train_s:.2f}s vs generate "
                     f"{generate_s:.2f}s, {ratio:.2f}x < {margin}): each role keeps its "
                     "own cores")


def keep_shared(split_step_s: float, shared_step_s: float
                ) -> tuple[Literal["split", "shared"], str]:
    """After trying shared for as many steps as split was measured: keep the faster."""
    if shared_step_s < split_step_s:
        return "shared", (f"shared measured faster ({shared_step_s:.3f} s/step vs split "
                          f"{split_step_s:.3f})")
    return "split", (f"shared measured slower ({shared_step_s:.3f} s/step vs split "
                     f"{split_step_s:.3f}): back to split")



class AutoLayout:
    """Picks split or shared for one run; ``choice`` is "" while it is still measuring."""

    def __init__(self, rollout: Mapping[int, RolloutClient], trainers: Sequence[TrainerClient],
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
            await self._set_sharing(True)
        elif step == AUTO_WARMUP_STEPS + 2 * AUTO_PROBE_STEPS:
            shared_step_s = (now - probe["shared_from"]) / AUTO_PROBE_STEPS
            choice, why = keep_shared(probe["split_step_s"], shared_step_s)
            if choice == "split":
                await self._set_sharing(False)
            self._pick(choice, step, why)

    def _pick(self, choice: str, step: int, why: str) -> None:
        self.choice = choice
        print(f"run.layout auto -> {choice} after step {step}: {why}")

    async def _set_sharing(self, enabled: bool) -> None:
        async with anyio.create_task_group() as calls:
            for trainer in self._trainers:
                calls.start_soon(trainer.set_sharing, enabled)

    async def _rollout_busy_s(self) -> float:
        """Mean busy seconds of the live rollout workers since they started."""
        values = [await w.busy_seconds() for w in list(self._rollout.values())]
        return sum(values) / max(len(values), 1)
