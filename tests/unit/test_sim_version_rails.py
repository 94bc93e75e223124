"""The terms of 2026-12-07, each against a hand computation: the "p2p" weight path (every
receiving device pulls its shard at once, no snapshot and no fixed pauses, the engine's
per-tensor calls alone), NIC rails (``weights_rails`` striped over at most a node's
``nic_rails`` shared by its busy devices) and a mixture of experts' training MFU; with
their defaults, nothing changes."""

from __future__ import annotations

import msgspec
import pytest

from async_rl.config import Config
from async_rl.sim.costs import Costs, ModelShape
from async_rl.sim.hardware_file import load_hardware
from async_rl.sim.parallel import Links
from async_rl.sim.run import simulation_costs
from async_rl.sim.version_stages import VersionPath
from buffers.common.config import ConfigError

LINKS = Links(per_node=8, intra_bandwidth=400e9, intra_latency=1e-5, inter_bandwidth=50e9,
              inter_latency=3e-5)
BUCKET = 16 << 20


def path(kind: str, *, version: float = 1e9, engine_devices: int = 2, rails: int = 1,
         nic_rails: int = 0, tensors: int = 0, tensor_s: float = 0.0) -> VersionPath:
    return VersionPath(kind, state_bytes=1e9, version_bytes=version, holders=16,
                       engine_devices=engine_devices, trainer_devices=16, links=LINKS,
                       memory_bandwidth=2e12, host_bandwidth=64e9, interconnect=50e9,
                       publish_s=0.5, load_s=0.5, member_s=0.001, tensors=tensors,
                       tensor_s=tensor_s, rails=rails, nic_rails=nic_rails)


def test_p2p_pulls_shards_with_no_snapshot_and_no_fixed_pause() -> None:
    p2p = path("p2p", tensors=1000, tensor_s=1e-3)
    assert (p2p.gather(), p2p.convert(), p2p.stage()) == (0.0, 0.0, 0.0)
    # 4 engines of 2 devices: each device 0.5 GB at 50 GB/s (0.01 s); 16 senders send
    # 4 GB at 50 GB/s each (0.005 s): the receivers bound, plus one message.
    assert p2p.transfer(4, BUCKET) == pytest.approx(0.5e9 / 50e9 + 3e-5)
    # 64 engines: the senders' 64 GB over 16 NICs (0.08 s) bound.
    assert p2p.transfer(64, BUCKET) == pytest.approx(64e9 / (16 * 50e9) + 3e-5)
    assert p2p.load() == pytest.approx(1.0)  # the calls alone, not weight_load_s
    assert path("p2p").load() == 0.0
    # FP8 from bf16: each trainer device converts its slice.
    assert path("p2p", version=0.5e9).convert() == pytest.approx(1.5e9 / (2e12 * 16))


def test_rails_a_device_uses_are_its_share_of_the_node() -> None:
    two = path("direct", rails=2, nic_rails=8)
    assert two.rails_used(1) == 2 and two.rails_used(4) == 2  # 8 rails / 4 busy
    assert two.rails_used(8) == 1 and two.rails_used(64) == 1  # one a device
    assert path("direct", rails=4, nic_rails=4).rails_used(2) == 2
    assert path("direct", rails=8).rails_used(1) == 8  # nic_rails 0: one a device
    assert path("direct").rails_used(1) == 1  # the default: one NIC


def test_rails_widen_the_broadcast_and_the_pulls() -> None:
    one, two = path("direct"), path("direct", rails=2, nic_rails=8)
    wire = (1e9 + 7 * BUCKET) / 50e9 + 8 * 0.001
    assert one.transfer(8, BUCKET) == pytest.approx(wire)
    assert two.transfer(8, BUCKET) == pytest.approx((1e9 + 7 * BUCKET) / 100e9 + 8 * 0.001)
    # One-device engines: each receiving device may take both rails.
    pulls = path("p2p", engine_devices=1, rails=2, nic_rails=8)
    assert pulls.transfer(1, BUCKET) == pytest.approx(1e9 / 100e9 + 3e-5)
    # Eight-device engines fill the node: one rail each, whatever was asked.
    full = path("p2p", engine_devices=8, rails=2, nic_rails=8)
    assert full.transfer(1, BUCKET) == pytest.approx(1e9 / 8 / 50e9 + 3e-5)


MOE = ModelShape(parameters=30e9, active_parameters=3e9, kv_bytes_per_token=98304,
                 bytes_per_parameter=2.0, experts_per_token=8)
DENSE = ModelShape(parameters=8e9, kv_bytes_per_token=131072, bytes_per_parameter=2.0)


def test_a_mixture_of_experts_trains_at_its_own_mfu() -> None:
    h = load_hardware("h100")
    assert h.moe_train_mfu == 0.0  # shipped: train_mfu for every model
    token = 6 * 3e9 / (989e12 * 0.35)
    assert Costs(h, MOE).micro_batch([1]) == pytest.approx(h.micro_batch_s + token)
    moe = msgspec.structs.replace(h, moe_train_mfu=0.25)
    assert Costs(moe, MOE).micro_batch([1000]) == pytest.approx(
        h.micro_batch_s + 1000 * 6 * 3e9 / (989e12 * 0.25))
    # A dense model keeps train_mfu.
    assert Costs(moe, DENSE).micro_batch([1000]) == pytest.approx(
        Costs(h, DENSE).micro_batch([1000]))


def _config(**simulate: object) -> Config:
    return msgspec.convert({
        "model": {"path": "not-needed"},
        "simulate": {"hardware": "h100", "parameters": 30e9, "kv_bytes_per_token": 98304,
                     **simulate}}, Config)


def test_the_config_reaches_the_path_and_the_rails() -> None:
    plain = simulation_costs(_config())
    assert plain.plan.weights_rails == 1 and plain.version_path.rails == 1
    costs = simulation_costs(_config(weights_path="p2p", weights_rails=2,
                                     hardware_overrides={"nic_rails": 8}))
    assert costs.version_path.path == "p2p" and costs.version_path.rails_used(1) == 2
    assert costs.publish() == 0.0 and costs.load() == 0.0
    with pytest.raises(ConfigError, match=r"simulate\.weights_rails = 9"):
        simulation_costs(_config(weights_rails=9, hardware_overrides={"nic_rails": 8}))
