"""Predicts the published figures of ``bench.simulator.published_scale_setups`` (the
development set since 2026-12-06: weight-sync times of three frameworks, NeMo RL v0.4's
mixture-of-experts step times), with ``--setups heldout`` those of
``bench.simulator.published_heldout_setups`` (development since 2026-12-07: weight-sync
times of four frameworks, NeMo RL v0.6's step times), with ``--setups heldout2`` those
of ``bench.simulator.published_heldout2_setups`` (development since 2026-12-07's second
round: weight-sync times of miles and verl) or, with ``--setups heldout3``, those of
``bench.simulator.published_heldout3_setups`` (held out: weight-sync times of verl, NeMo
RL, slime and Perplexity), and prints each prediction beside its figure, then how many
are within 25%.

    python -m bench.simulator.sim_published_scale
    python -m bench.simulator.sim_published_scale --setups heldout
    python -m bench.simulator.sim_published_scale --setups heldout2
    python -m bench.simulator.sim_published_scale --setups heldout3
    python -m bench.simulator.sim_published_scale --steps 4 --only sync
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec

from async_rl.analysis.results import step_split
from async_rl.config import Config
from async_rl.run.run_dir import read_metrics
from async_rl.sim.costs import Costs, ModelShape, Plan
from async_rl.sim.hardware_file import load_hardware
from async_rl.sim.parallel import Layout
from async_rl.sim.run import simulate
from bench.simulator.published_heldout2_setups import HELDOUT2_SYNCS
from bench.simulator.published_heldout3_setups import HELDOUT3_SYNCS
from bench.simulator.published_heldout_setups import HELDOUT_STEPS, HELDOUT_SYNCS
from bench.simulator.published_scale_setups import (
    ARCHITECTURES,
    MOE_TRAIN_MFU,
    STEPS,
    WEIGHT_SYNCS,
    Step,
)
from bench.simulator.published_scale_setups import WeightSync as Sync
from bench.simulator.sim_published_unseen import Run

BUCKET = 16 << 20


def sync_seconds(s: Sync) -> float:
    """A version's stages for the setup (colocated: an engine's reload)."""
    base = load_hardware(s.hardware)
    hardware = msgspec.structs.replace(
        base, interconnect_bandwidth=s.interconnect,
        intra_node_bandwidth=s.intra_node_bandwidth or base.intra_node_bandwidth,
        devices_per_rollout_worker=s.engine_devices,
        devices_per_trainer_shard=s.trainer_devices, weight_tensor_s=s.tensor_s,
        host_bandwidth=s.host_bandwidth or base.host_bandwidth)
    shape = ModelShape(parameters=s.parameters, kv_bytes_per_token=1,
                       bytes_per_parameter=2.0, tensors=s.tensors)
    path = "direct" if s.path == "time" else s.path
    costs = Costs(hardware, shape, Plan(
        trainer=Layout(tp=s.holders, pp=s.stages, given=s.path == "gathered"), shards=1,
        weights_path=path,
        version_bytes_per_parameter=s.bytes_per_parameter, version_native=s.native,
        version_fraction=s.fraction,
        weights_rails=s.rails))
    if s.path == "time":  # the fixed costs as committed: the file's 0 at the time
        costs = Costs(msgspec.structs.replace(hardware, engine_release_s=0.0,
                                              engine_reload_s=0.0), shape, costs.plan)
        return costs.release() + costs.reload()
    stages = costs.version_stages(s.receivers, BUCKET)
    return stages.trainer_s + stages.transfer + stages.load


def step_config(step: Step, out: Path, steps: int) -> Config:
    run = Run(model=step.model, gpus=step.gpus, off_policy=step.off_policy,
              generate_tp=step.generate_tp,
              train_devices=step.train[0] * step.train[1] * step.train[3],
              prompts=step.prompts, samples=32, max_length=step.max_length,
              mean_response=step.mean_response, in_flight=step.in_flight,
              published_s=step.published_s, rollout_gpus=step.rollout_gpus)
    config = run.config(out, steps)
    if step.off_policy and step.staleness != 1:
        config = msgspec.structs.replace(config, staleness=msgspec.structs.replace(
            config.staleness, max_staleness=step.staleness))
    tp, cp, ep, pp = step.train
    arch = ARCHITECTURES[step.model.name]
    sim = msgspec.convert({
        **msgspec.to_builtins(config.simulate),
        "rollout_layout": {"tp": step.generate_tp},
        "trainer_layout": {"tp": tp, "cp": cp, "ep": ep, "pp": pp},
        "architecture": msgspec.to_builtins(arch),
        "old_logprob_pass": "always",
        "hardware_overrides": {"device_memory": run.device_bytes,
                               "moe_train_mfu": MOE_TRAIN_MFU}}, type(config.simulate))
    return msgspec.structs.replace(config, simulate=sim)


def step_seconds(step: Step, steps: int) -> float:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "run"
        simulate(step_config(step, out, steps))
        split = step_split(read_metrics(out), 1 if step.off_policy else 0)
    assert split is not None
    return split.step_s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", choices=("sync", "steps", "all"), default="all")
    parser.add_argument("--setups", choices=("development", "heldout", "heldout2", "heldout3"),
                        default="development")
    args = parser.parse_args(argv)
    heldout = args.setups == "heldout"
    syncs, steps = {"development": (WEIGHT_SYNCS, STEPS),
                    "heldout": (HELDOUT_SYNCS, HELDOUT_STEPS),
                    "heldout2": (HELDOUT2_SYNCS, ()),
                    "heldout3": (HELDOUT3_SYNCS, ())}[args.setups]
    logging.getLogger("async_rl").setLevel(logging.WARNING)
    print("| figure | source | published s | predicted s | error |")
    print("| --- | --- | --- | --- | --- |")
    within = total = 0

    def row(name: str, source: str, published: float, predicted: float) -> None:
        nonlocal within, total
        error = predicted / published - 1
        within += abs(error) <= 0.25
        total += 1
        print(f"| {name} | {source} | {published:g} | {predicted:.2f} | {100 * error:+.0f}% |",
              flush=True)

    if args.only in ("sync", "all"):
        for sync in syncs:
            row(f"weight sync: {sync.name}", sync.framework, sync.published_s,
                sync_seconds(sync))
    if args.only in ("steps", "all"):
        for step in steps:
            how = f"{step.staleness}-step off" if step.off_policy else "on-policy"
            seen = "" if not step.seen else " (seen before)"
            label = f" ({step.label})" if step.label else ""
            row(f"step: {step.model.name} {how} on {step.gpus} H100{label}{seen}",
                "NeMo RL v0.6" if heldout else "NeMo RL v0.4", step.published_s,
                step_seconds(step, args.steps))
    print(f"within 25%: {within} of {total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
