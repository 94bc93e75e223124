"""The weight paths of 2026-12-07's second round, each against a hand computation:
"stage_heads" (each pipeline stage gathered onto its head rank and broadcast to every
engine device, the stages in turn) and "host_replica" (each stage gathered, the stages at
once, every rank copying its targets' parts into a host replica and writing them)."""

from __future__ import annotations

import pytest

from async_rl.sim.costs import Costs, ModelShape, Plan
from async_rl.sim.hardware_file import load_hardware
from async_rl.sim.parallel import Layout, Links
from async_rl.sim.version_stages import VersionPath

LINKS = Links(per_node=8, intra_bandwidth=400e9, intra_latency=1e-5, inter_bandwidth=50e9,
              inter_latency=3e-5)
BUCKET = 16 << 20


def path(kind: str, *, trainer: int = 32, stages: int = 4, engine_devices: int = 8,
         version: float = 8e9, host_copy: float = 4e9) -> VersionPath:
    return VersionPath(kind, state_bytes=8e9, version_bytes=version, holders=trainer,
                       engine_devices=engine_devices, trainer_devices=trainer, links=LINKS,
                       memory_bandwidth=2e12, host_bandwidth=64e9, interconnect=50e9,
                       publish_s=0.5, load_s=0.5, member_s=0.001, tensors=1000,
                       tensor_s=1e-4, pipeline_stages=stages,
                       host_copy_bandwidth=host_copy)


def test_stage_heads_gather_and_broadcast_each_stage_in_turn() -> None:
    heads = path("stage_heads")
    # 8 ranks a stage fit one node: each receives 7/8 of the stage's 2 GB over NVLink.
    stage_gather = 7 / 8 * 2e9 / 400e9 + 1e-5
    assert heads.stage_gather() == pytest.approx(stage_gather)
    assert heads.gather() == pytest.approx(4 * stage_gather)
    assert (heads.convert(), heads.stage()) == (0.0, 0.0)
    # 2 engines of 8 devices: 16 members; each stage's 2 GB down a chain, in turn.
    wire = (2e9 + 15 * BUCKET) / 50e9 + 16 * 0.001
    assert heads.transfer(2, BUCKET) == pytest.approx(4 * wire)
    assert heads.load() == pytest.approx(0.5 + 1000 * 1e-4)  # the pause and the calls
    # A stage spanning nodes gathers over the NIC.
    wide = path("stage_heads", trainer=64, stages=4)
    assert wide.stage_gather() == pytest.approx(15 / 16 * 2e9 / 50e9 + 3e-5)


def test_host_replica_copies_each_target_part_then_writes_it() -> None:
    replica = path("host_replica")
    assert replica.gather() == pytest.approx(7 / 8 * 2e9 / 400e9 + 1e-5)  # stages at once
    assert (replica.convert(), replica.stage()) == (0.0, 0.0)
    # 2 engines of 8 devices = 16 targets over a stage's 8 ranks: 2 each, one by one;
    # a target's part is 8 GB / (4 stages x 8 devices) = 0.25 GB, copied at 4 GB/s and
    # written at 50 GB/s (8 ranks of a node share its 8 rails: one each).
    assert replica.transfer(2, BUCKET) == pytest.approx(
        2 * 0.25e9 * (1 / 4e9 + 1 / 50e9) + 3e-5)
    assert replica.load() == pytest.approx(1000 * 1e-4)  # the calls alone, no pause
    # 20 targets over 8 ranks: the busiest serves 3.
    assert path("host_replica", engine_devices=10).transfer(2, BUCKET) == pytest.approx(
        3 * 0.2e9 * (1 / 4e9 + 1 / 50e9) + 3e-5)
    # No copy rate given: the host link's.
    assert path("host_replica", host_copy=0.0).host_copy_bandwidth == 64e9


def test_one_stage_one_rank_gathers_nothing() -> None:
    single = path("stage_heads", trainer=1, stages=1)
    assert single.gather() == 0.0
    assert single.transfer(1, BUCKET) == pytest.approx(
        (8e9 + 7 * BUCKET) / 50e9 + 8 * 0.001)
    # More stages than devices: one rank a stage, no gather.
    assert path("host_replica", trainer=2, stages=4).gather() == 0.0


def test_costs_take_the_trainer_layouts_stages_and_the_copy_rate() -> None:
    hardware = load_hardware("h100")
    shape = ModelShape(parameters=4e9, kv_bytes_per_token=1, bytes_per_parameter=2.0)
    costs = Costs(hardware, shape, Plan(trainer=Layout(tp=2, pp=4, given=True),
                                        weights_path="host_replica"))
    assert costs.version_path.pipeline_stages == 4
    assert costs.version_path.host_copy_bandwidth == (
        hardware.host_copy_bandwidth or hardware.host_bandwidth)
    # The default path is untouched by the stages.
    direct = Costs(hardware, shape, Plan(trainer=Layout(tp=2, pp=4, given=True)))
    assert direct.version_path.gather() == 0.0
