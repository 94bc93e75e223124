"""The simulator's collective weight cost against real CPU runs with 1, 2 and 4 engines.

Real runs: ``examples/cpu_default.toml`` (the small model) at max_staleness 2 with
``rollout.num_workers`` 1, 2 and 4, 40 steps each (``bench/simulator/sim_vs_real.py``'s real runs,
trained under ``flock --lock`` when missing). The simulator is calibrated the way the
project calibrates it (``async-rl simulate --calibrate``) on the one-engine run only;
each run's config is then simulated with that hardware file and the calibration run's
generated lengths. Printed per engine count, real against simulated, per version and
engine (medians over the versions): the wire (``transfer_s``: bytes arriving), the load
(the rest of the pause), and the rollout spans' weight causes per version (weight_wire,
weight_load, weight_sync: waiting on the group and the trainer's calls), with the
formula's wire ``(S + (E-1)·min(B, S)) / link + E·m`` beside them. Then the real wire's
growth per extra engine (least squares over the engine counts) against the formula's
``min(B, S) / link + m``: whether the per-member term is what the real path pays.

    python -m bench.simulator.sim_weight_engines --lock /tmp/async-rl-heavy.lock
    python -m bench.simulator.sim_weight_engines --existing --out runs/sim-weights
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from async_rl.analysis.report import read_spans
from async_rl.config_io import load_config
from async_rl.run.run_dir import CONFIG, read_ledger, read_metrics
from async_rl.sim.calibrate import calibrate
from async_rl.sim.costs import Costs
from async_rl.sim.hardware_file import load_hardware
from async_rl.sim.run import simulation_costs
from bench.simulator.sim_vs_real import predict, real_run

ENGINES = (1, 2, 4)
STALENESS = 2
CAUSES = ("weight_wire", "weight_load", "weight_sync")


def per_version(run_dir: Path) -> dict[str, float]:
    """Medians over a run's versions of the mean over its engines: wire and load seconds
    (the broadcast timings), and the rollout spans' seconds in each weight cause."""
    by_version: dict[int, list[dict[str, object]]] = defaultdict(list)
    for row in read_metrics(run_dir):
        for timing in row["broadcast"]:  # type: ignore[attr-defined]
            by_version[int(timing["version"])].append(timing)
    assert by_version, f"{run_dir}: no broadcast timings"
    figures = {
        "wire": statistics.median(statistics.fmean(float(t["transfer_s"]) for t in ts)
                                  for ts in by_version.values()),
        "load": statistics.median(statistics.fmean(float(t["load_s"]) for t in ts)
                                  for ts in by_version.values()),
    }
    spans = [s for s in read_spans(run_dir) if s.role == "rollout" and s.cause in CAUSES]
    engines = {s.worker for s in read_spans(run_dir) if s.role == "rollout"}
    versions = len(by_version)
    for cause in CAUSES:
        total = sum(s.end - s.start for s in spans if s.cause == cause)
        figures[cause] = total / max(versions * len(engines), 1)
    return figures


def formula(costs: Costs, engines: int, bucket_bytes: float) -> float:
    return costs.transfer(engines, bucket_bytes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--out", default="runs/sim-weights")
    parser.add_argument("--lock", default="", help="run each real run under flock FILE")
    parser.add_argument("--existing", action="store_true",
                        help="only the real runs already in --out: train none")
    args = parser.parse_args(argv)
    logging.getLogger("async_rl").setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lock = None if args.existing else args.lock
    reals = {e: real_run("default", STALENESS, e, out, lock) for e in ENGINES}
    found = {e: r for e, r in reals.items() if r is not None}
    if 1 not in found:
        print("no one-engine run to calibrate on")
        return 1
    hardware = found[1] / "hardware.toml"
    fit = calibrate(found[1], hardware)
    print(f"calibrated on {found[1]}:\n{fit.describe()}", flush=True)
    replay = any(e.lengths for e in read_ledger(found[1]) if e.event == "generated")
    lengths = f'"{found[1]}"' if replay else '"task"'
    config = load_config(found[1] / CONFIG, [f'simulate.hardware="{hardware}"'])
    costs = Costs(load_hardware(str(hardware)), simulation_costs(config).model)
    bucket = config.weights.bucket_mb << 20
    print(f"model {costs.weight_bytes / 1e6:.1f} MB, bucket {bucket / 2**20:g} MiB, link "
          f"{costs.hardware.interconnect_bandwidth / 1e6:.1f} MB/s, weight_member_s "
          f"{costs.hardware.weight_member_s * 1e3:.1f} ms, weight_load_s "
          f"{costs.hardware.weight_load_s * 1e3:.1f} ms")
    print("| engines | wire ms real | sim | formula | load ms real | sim "
          "| weight_wire / weight_load / weight_sync ms per version and engine, real "
          "| sim |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    real_wire = {}
    for engines, run_dir in found.items():
        sim_dir = predict(run_dir, hardware, lengths, out)
        real, sim = per_version(run_dir), per_version(sim_dir)
        real_wire[engines] = real["wire"]
        print(f"| {engines} | {1e3 * real['wire']:.1f} | {1e3 * sim['wire']:.1f} "
              f"| {1e3 * formula(costs, engines, bucket):.1f} | {1e3 * real['load']:.1f} "
              f"| {1e3 * sim['load']:.1f} | "
              + " / ".join(f"{1e3 * real[c]:.1f}" for c in CAUSES) + " | "
              + " / ".join(f"{1e3 * sim[c]:.1f}" for c in CAUSES) + " |", flush=True)
    if len(real_wire) >= 2:
        counts = np.array(sorted(real_wire), dtype=float)
        wires = np.array([real_wire[int(e)] for e in counts])
        slope, intercept = np.polyfit(counts - 1, wires, 1)
        per_member = formula(costs, 2, bucket) - formula(costs, 1, bucket)
        print(f"real wire per extra engine: {1e3 * slope:.1f} ms (at one engine "
              f"{1e3 * intercept:.1f} ms); the formula's min(B, S)/link + m: "
              f"{1e3 * per_member:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
