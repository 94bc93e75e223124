"""The terms a weight version and a pipelined trainer pay at scale, each against a hand
computation: the "host" path (a version in host memory, copied up and broadcast,
pipelined), a tensor-by-tensor framework's calls, a version already at its dtype (no
conversion), the tensors a version carries, and a pipeline's fill and drain; with their
defaults, nothing changes."""

from __future__ import annotations

import msgspec
import pytest

from async_rl.config import Config
from async_rl.sim.costs import Costs, ModelShape, Plan
from async_rl.sim.hardware_file import load_hardware
from async_rl.sim.parallel import Layout, Links
from async_rl.sim.refit import refit_stages
from async_rl.sim.run import simulation_costs
from async_rl.sim.version_stages import VersionPath, version_tensors

LINKS = Links(per_node=8, intra_bandwidth=400e9, intra_latency=1e-5, inter_bandwidth=50e9,
              inter_latency=3e-5)
BUCKET = 16 << 20


def path(kind: str, *, version: float = 1e9, interconnect: float = 50e9,
         native: bool = False, tensors: int = 0, tensor_s: float = 0.0) -> VersionPath:
    return VersionPath(kind, state_bytes=1e9, version_bytes=version, holders=16,
                       engine_devices=2, trainer_devices=16, links=LINKS,
                       memory_bandwidth=2e12, host_bandwidth=64e9,
                       interconnect=interconnect, publish_s=0.5, load_s=0.5,
                       member_s=0.001, native=native, tensors=tensors, tensor_s=tensor_s)


def test_host_path_pipelines_the_copies_up_with_the_broadcast() -> None:
    # NVLink at 200 GB/s: the host link (64 GB/s) bounds; one bucket fills at 200 GB/s.
    fast = path("host", interconnect=200e9)
    assert fast.gather() == 0.0 and fast.convert() == 0.0
    assert fast.stage() == 0.5  # in host memory already: the fixed part alone
    assert fast.transfer(8, BUCKET) == pytest.approx(1e9 / 64e9 + BUCKET / 200e9)
    assert fast.load() == 0.5
    # Across nodes at 50 GB/s the broadcast bounds; one bucket fills at 64 GB/s.
    slow = path("host", interconnect=50e9)
    wire = (1e9 + 15 * BUCKET) / 50e9 + 16 * 0.001
    assert slow.transfer(16, BUCKET) == pytest.approx(wire + BUCKET / 64e9)
    # One receiver, one bucket: the whole version a bucket.
    tiny = path("host", version=1e6, interconnect=200e9)
    assert tiny.transfer(1, BUCKET) == pytest.approx(
        max(1e6 / 64e9, 1e6 / 200e9 + 0.001) + 1e6 / 200e9)


def test_tensor_by_tensor_calls_are_paid_in_the_load() -> None:
    direct = path("direct", tensors=18_000, tensor_s=3e-4)
    assert direct.load() == pytest.approx(0.5 + 18_000 * 3e-4)  # 5.9 s
    gathered = path("gathered", tensors=18_000, tensor_s=3e-4)
    assert gathered.load() == pytest.approx(0.5 + 5.4 + 1e9 / (2e12 * 2))
    assert path("direct", tensors=18_000).load() == 0.5  # buckets: no per-tensor cost


def test_a_native_version_is_not_converted() -> None:
    assert path("direct", version=0.5e9).convert() == pytest.approx(1.5e9 / (2e12 * 16))
    assert path("direct", version=0.5e9, native=True).convert() == 0.0
    assert path("gathered", native=True).convert() == 0.0
    assert path("gathered").convert() == pytest.approx(2e9 / 2e12)


def test_version_tensors_count_by_hand() -> None:
    # Qwen3-30B-A3B's shape: 48 layers, every one with 128 experts.
    assert version_tensors(layers=48, moe_layers=48, experts=128) == (
        48 * 6 + 48 * (128 * 3 + 1) + 3) == 18_771
    # DeepSeek V3: 61 layers, 3 dense, 58 with 256 experts.
    assert version_tensors(layers=61, moe_layers=58, experts=256) == (
        61 * 6 + 58 * 769 + 3 * 3 + 3)
    assert version_tensors(layers=2, moe_layers=0, experts=0) == 2 * 6 + 2 * 3 + 3
    assert version_tensors(layers=0, moe_layers=0, experts=0) == 0


SHAPE = ModelShape(parameters=30e9, kv_bytes_per_token=98304, bytes_per_parameter=2.0,
                   tensors=18_771)


def test_costs_wire_the_terms_with_defaults_that_change_nothing() -> None:
    h = load_hardware("h100")
    assert h.weight_tensor_s == 0.0
    plain = Costs(h, SHAPE)
    assert plain.load() == h.weight_load_s  # no per-tensor cost by default
    calls = Costs(msgspec.structs.replace(h, weight_tensor_s=2e-4), SHAPE)
    assert calls.load() == pytest.approx(h.weight_load_s + 18_771 * 2e-4)
    assert calls.refit.copy == pytest.approx(
        plain.refit.copy + 18_771 * 2e-4)  # a colocated reload pays them too
    # FP8 from bf16 converts; an FP8 checkpoint does not, and gathers FP8 bytes.
    fp8 = Costs(h, SHAPE, Plan(version_bytes_per_parameter=1.0, weights_path="gathered"))
    native = Costs(h, SHAPE, Plan(version_bytes_per_parameter=1.0, weights_path="gathered",
                                  version_native=True))
    assert fp8.version_path.convert() > 0 and native.version_path.convert() == 0.0
    assert native.version_path.state_bytes == pytest.approx(30e9)
    host = Costs(h, SHAPE, Plan(weights_path="host"))
    assert host.publish() == h.publish_s


def test_refit_calls_join_the_copy() -> None:
    base = dict(weight_bytes=60e9, trained_bytes=60e9, version_bytes=60e9,
                optimizer_bytes=0.0, offload="none", sleep_level=2, trainer_devices=8,
                holders=1, engine_devices=4, host_bandwidth=64e9, memory_bandwidth=4e12,
                links=LINKS)
    plain = refit_stages(**base)  # type: ignore[arg-type]
    calls = refit_stages(**base, calls_s=5.0)  # type: ignore[arg-type]
    assert plain.copy == pytest.approx(60e9 / (4e12 * 4))
    assert calls.copy == pytest.approx(plain.copy + 5.0)
    assert calls.reload_s == pytest.approx(plain.reload_s + 5.0)


def test_pipeline_bubble_by_hand() -> None:
    h = load_hardware("h100")
    pp8 = Costs(h, SHAPE, Plan(trainer=Layout(tp=2, pp=8, given=True)))
    assert pp8.pipeline_bubble(32) == pytest.approx((32 + 7) / 32)
    assert pp8.pipeline_bubble(1) == pytest.approx(8.0)  # one micro-batch: no overlap
    assert pp8.pipeline_bubble(0) == 1.0
    # The bubble's share of the whole: (pp - 1) / (m + pp - 1).
    assert 1 - 1 / pp8.pipeline_bubble(32) == pytest.approx(7 / 39)
    assert Costs(h, SHAPE).pipeline_bubble(32) == 1.0  # no layout given
    assert Costs(h, SHAPE, Plan(trainer=Layout(tp=8, given=True))).pipeline_bubble(4) == 1.0


def _config(**simulate: object) -> Config:
    return msgspec.convert({
        "model": {"path": "not-needed"},
        "simulate": {"hardware": "h100", "parameters": 30e9, "kv_bytes_per_token": 98304,
                     **simulate}}, Config)


def test_the_config_reaches_the_tensors_and_the_native_version() -> None:
    arch = {"layers": 48, "hidden_size": 2048, "experts": 128, "experts_per_token": 8}
    counted = simulation_costs(_config(architecture=arch))
    assert counted.model.tensors == 18_771 and counted.version_path.tensors == 18_771
    given = simulation_costs(_config(architecture=arch, version_tensors=100,
                                     weights_path="host", version_native=True,
                                     version_bytes_per_parameter=1.0,
                                     hardware_overrides={"weight_tensor_s": 1e-3}))
    assert given.version_path.tensors == 100 and given.version_path.path == "host"
    assert given.load() == pytest.approx(given.hardware.weight_load_s + 0.1)
    assert given.version_path.native and given.version_path.convert() == 0.0
    assert simulation_costs(_config()).model.tensors == 0  # no shape: none counted
