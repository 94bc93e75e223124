"""A weight version as stages (simulate.weights_path): each stage against a hand
computation, "direct" as the simulator's costs before the stages, "gathered" paying a
gather, a conversion, host staging and a copy into each engine, versions of FP8 and delta
sizes, and the stages in sim.json and the result table."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from async_rl.analysis.results import SIM_STATS, SimStats, result_table
from async_rl.api import simulate
from async_rl.config import Config
from async_rl.run.run_dir import read_metrics
from async_rl.sim.costs import Costs, ModelShape, Plan
from async_rl.sim.hardware_file import load_hardware
from async_rl.sim.parallel import Links
from async_rl.sim.run import simulation_costs
from async_rl.sim.version_stages import VersionPath

LINKS = Links(per_node=8, intra_bandwidth=400e9, intra_latency=1e-5, inter_bandwidth=50e9,
              inter_latency=3e-5)
BUCKET = 16 << 20


def path(kind: str, *, version: float = 1e9, holders: int = 16) -> VersionPath:
    return VersionPath(kind, state_bytes=1e9, version_bytes=version, holders=holders,
                       engine_devices=2, trainer_devices=16, links=LINKS,
                       memory_bandwidth=2e12, host_bandwidth=64e9, interconnect=50e9,
                       publish_s=0.5, load_s=0.5, member_s=0.001)


def test_gathered_stages_against_a_hand_computation() -> None:
    p = path("gathered")
    # 16 holders on two nodes: the ring crosses the network; each receives 15/16.
    assert p.gather() == pytest.approx(15 / 16 * 1e9 / 50e9 + 3e-5)
    assert p.convert() == pytest.approx((1e9 + 1e9) / 2e12)  # read bf16, write the version
    assert p.stage() == pytest.approx(0.5 + 1e9 / 64e9)  # into host memory
    assert p.transfer(4, BUCKET) == pytest.approx((1e9 + 3 * BUCKET) / 50e9 + 4 * 0.001)
    assert p.load() == pytest.approx(0.5 + 1e9 / (2e12 * 2))  # copied on 2 devices
    stages = p.stages(4, BUCKET)
    assert stages.trainer_s == pytest.approx(p.gather() + p.convert() + p.stage())
    # Holders within one node gather over its links.
    assert path("gathered", holders=8).gather() == pytest.approx(7 / 8 * 1e9 / 400e9 + 1e-5)
    assert path("gathered", holders=1).gather() == 0.0


def test_direct_stages_are_the_snapshot_the_broadcast_and_a_fixed_load() -> None:
    p = path("direct")
    assert p.gather() == 0.0 and p.convert() == 0.0
    assert p.stage() == pytest.approx(0.5 + 1e9 / 2e12)  # in device memory
    assert p.load() == 0.5
    # An FP8 version is converted by every trainer device, its slice each.
    fp8 = path("direct", version=0.5e9)
    assert fp8.convert() == pytest.approx((1e9 + 0.5e9) / (2e12 * 16))
    assert fp8.transfer(1, BUCKET) == pytest.approx(0.5e9 / 50e9 + 0.001)


SHAPE = ModelShape(parameters=7e9, kv_bytes_per_token=57344, bytes_per_parameter=2.0)


def test_direct_by_default_costs_what_the_simulator_did_before_the_stages() -> None:
    h = load_hardware("h100")
    costs = Costs(h, SHAPE)
    size = 7e9 * 2
    assert costs.publish() == pytest.approx(h.publish_s + size / (
        h.memory_bandwidth * h.memory_efficiency))
    assert costs.transfer(8, BUCKET) == pytest.approx((size + 7 * BUCKET)
                                                      / h.interconnect_bandwidth)
    assert costs.load() == h.weight_load_s


def test_fp8_and_delta_versions_carry_fewer_bytes() -> None:
    h = load_hardware("h100")
    fp8 = Costs(h, SHAPE, Plan(version_bytes_per_parameter=1.0))
    assert fp8.version_bytes == pytest.approx(7e9)
    delta = Costs(h, SHAPE, Plan(version_fraction=0.1))
    assert delta.version_bytes == pytest.approx(0.1 * 7e9 * 2)
    assert fp8.weight_bytes == delta.weight_bytes == 14e9  # the engines still hold bf16


def config(out: Path, *, staleness: int = 1, run: dict[str, object] | None = None,
           **simulate_: object) -> Config:
    """A small simulated long-tail run (``run``: more run keys)."""
    return msgspec.convert({
        "model": {"path": "not-needed"},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"num_workers": 2, "group_size": 4, "max_new_tokens": 128,
                    "max_inflight_prompts": 8},
        "queue": {"max_groups": 64, "bucket_edges": [128, 512]},
        "staleness": {"max_staleness": staleness},
        "trainer": {"num_shards": 2, "groups_per_step": 8, "micro_batch_tokens": 512},
        "run": {"num_steps": 4, "output_dir": str(out), "progress": False, "eval_every": 0,
                **(run or {})},
        "simulate": {"parameters": 4.0e8, "kv_bytes_per_token": 4096, "lengths": "lognormal",
                     "length_median": 30.0, "length_sigma": 0.8, "hardware": "h100",
                     **simulate_},
    }, Config)


def test_a_gathered_run_pays_its_stages_and_shows_them(tmp_path: Path) -> None:
    cfg = config(tmp_path / "g", weights_path="gathered",
                 hardware_overrides={"devices_per_trainer_shard": 8})
    costs = simulation_costs(cfg)
    h = costs.hardware
    size = 4e8 * costs.model.bytes_per_parameter
    # 2 shards of 8 devices hold a slice each (FSDP over all 16): the ring crosses nodes.
    gather = 15 / 16 * size / h.inter_node_bandwidth + h.inter_node_latency
    memory = h.memory_bandwidth * h.memory_efficiency
    expected = gather + 2 * size / memory + h.publish_s + size / h.host_bandwidth
    assert costs.publish() == pytest.approx(expected)
    simulate(cfg)
    rows = read_metrics(tmp_path / "g")
    publishes = [b["publish_s"] for r in rows for b in r["broadcast"]]
    assert len(publishes) >= 2
    assert publishes[0] == pytest.approx(expected)
    stats = msgspec.json.decode((tmp_path / "g" / SIM_STATS).read_bytes(), type=SimStats)
    assert stats.weights_path == "gathered"
    assert list(stats.version_stages) == ["gather", "convert", "stage", "transfer", "load"]
    assert stats.version_stages["gather"] == pytest.approx(gather)
    console = Console(width=200, record=True)
    console.print(result_table(tmp_path / "g", []))
    text = console.export_text()
    assert "gathered version: gather" in text
    assert "; transfer " in text


def test_direct_is_the_default_and_a_gathered_version_takes_longer(tmp_path: Path) -> None:
    direct = simulation_costs(config(tmp_path / "d"))
    assert direct.plan.weights_path == "direct"
    gathered = simulation_costs(config(tmp_path / "g", weights_path="gathered"))
    assert gathered.publish() > direct.publish()
    assert gathered.load() > direct.load()
