"""A colocated refit from first principles (run.colocate = "time"): each part of a turn
against a hand computation (the optimizer's state over the host link, the engine's
weights on sleep level 1, the reshard between layouts, the version's copy), the fixed
costs a hardware file gives winning, the degenerate setups (nothing offloaded, one
device), and the derived turn reaching a simulated run, sim.json and the result table."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from rich.console import Console
from test_sim_version_stages import config as stages_config

from async_rl.analysis.results import SIM_STATS, SimStats, result_table
from async_rl.api import simulate
from async_rl.config import Config
from async_rl.sim.costs import Costs, ModelShape, Plan
from async_rl.sim.hardware_file import hardware_toml, load_hardware
from async_rl.sim.parallel import Links
from async_rl.sim.refit import refit_stages
from async_rl.sim.run import simulation_costs

LINKS = Links(per_node=8, intra_bandwidth=400e9, intra_latency=1e-5, inter_bandwidth=50e9,
              inter_latency=3e-5)
GB = 1e9


def stages(**changes: object):  # type: ignore[no-untyped-def]
    """A 7B model in bf16 (14 GB), Adam's 12 bytes a parameter (84 GB), on 8 devices of
    one node, each with a 64 GB/s host link and 2 TB/s of memory."""
    given: dict[str, object] = dict(
        weight_bytes=14 * GB, trained_bytes=14 * GB, version_bytes=14 * GB,
        optimizer_bytes=84 * GB, offload="optimizer", sleep_level=2, trainer_devices=8,
        holders=8, engine_devices=1, host_bandwidth=64 * GB, memory_bandwidth=2e12,
        links=LINKS)
    return refit_stages(**{**given, **changes})  # type: ignore[arg-type]


def test_the_optimizer_goes_to_host_and_back_and_the_weights_are_resharded() -> None:
    r = stages()
    optimizer = 84 * GB / 8 / (64 * GB)  # each device its shard over its own link
    assert r.trainer_onload == pytest.approx(optimizer) == pytest.approx(0.1640625)
    assert r.trainer_offload == pytest.approx(optimizer)
    assert r.engine_offload == r.engine_onload == 0.0  # sleep level 2: weights discarded
    reshard = 7 / 8 * 14 * GB / (400 * GB) + 1e-5  # an all-gather among 8 within a node
    assert r.reshard == pytest.approx(reshard)
    assert r.copy == pytest.approx(14 * GB / 2e12)
    assert r.release_s == pytest.approx(optimizer)
    assert r.reload_s == pytest.approx(optimizer + reshard + 14 * GB / 2e12)
    assert r.derived


def test_offloading_the_weights_too_and_a_sleep_level_one_engine() -> None:
    every = stages(offload="all")
    assert every.trainer_onload == pytest.approx((84 * GB / 8 + 14 * GB / 8) / (64 * GB))
    level_one = stages(sleep_level=1, engine_devices=2)
    engine = 14 * GB / 2 / (64 * GB)  # an engine of 2 devices: each moves half the weights
    assert level_one.engine_offload == pytest.approx(engine)
    assert level_one.engine_onload == pytest.approx(engine)
    assert level_one.release_s == pytest.approx(engine + 84 * GB / 8 / (64 * GB))
    assert level_one.copy == pytest.approx(14 * GB / (2e12 * 2))


def test_holders_over_nodes_reshard_over_the_network() -> None:
    r = stages(trainer_devices=16, holders=16)
    assert r.reshard == pytest.approx(15 / 16 * 14 * GB / (50 * GB) + 3e-5)
    assert r.trainer_onload == pytest.approx(84 * GB / 16 / (64 * GB))


def test_degenerate_turns_cost_only_the_copy() -> None:
    # Nothing offloaded, one device (nothing to reshard), weights discarded: the copy,
    # today's reload with no fixed cost.
    alone = stages(offload="none", trainer_devices=1, holders=1)
    assert alone.release_s == 0.0
    assert alone.reload_s == pytest.approx(alone.copy) == pytest.approx(0.007)
    # An optimizer without state (SGD) offloads nothing either.
    stateless = stages(optimizer_bytes=0.0)
    assert stateless.trainer_onload == stateless.trainer_offload == 0.0
    assert stateless.reload_s == pytest.approx(stateless.reshard + stateless.copy)


def test_given_fixed_costs_win_and_the_copy_is_paid_besides() -> None:
    r = stages(release_s=0.5, reload_s=1.0)
    assert r.release_s == 0.5
    assert r.reload_s == pytest.approx(1.0 + 14 * GB / 2e12)
    assert not r.derived
    zero = stages(release_s=0.0, reload_s=0.0)  # a given 0 is a cost, not "not given"
    assert zero.release_s == 0.0 and zero.reload_s == pytest.approx(zero.copy)
    # One side given, the other derived.
    half = stages(release_s=0.25)
    assert half.release_s == 0.25 and half.derived
    assert half.reload_s == pytest.approx(stages().reload_s)


def test_costs_derive_the_turn_from_the_model_and_the_hardware_file() -> None:
    h = load_hardware("h100")
    assert h.engine_release_s is None and h.engine_reload_s is None  # derived by default
    shape = ModelShape(parameters=7e9, kv_bytes_per_token=57344, bytes_per_parameter=2.0)
    costs = Costs(h, shape, Plan(shards=8))
    optimizer = 12 * 7e9 / 8 / h.host_bandwidth
    reshard = 7 / 8 * 14e9 / h.intra_node_bandwidth + h.intra_node_latency
    copy = 14e9 / (h.memory_bandwidth * h.memory_efficiency)
    assert costs.release() == pytest.approx(optimizer)
    assert costs.reload() == pytest.approx(optimizer + reshard + copy)
    # docs/simulator.md's example: 7B in bf16 on 8 H100s.
    assert (round(costs.release(), 2), round(costs.reload(), 2)) == (0.16, 0.20)
    # With LoRA only the adapters are trained: their state and their reshard.
    lora = Costs(h, msgspec.structs.replace(shape, adapter_parameters=1e7), Plan(shards=8))
    assert lora.release() == pytest.approx(12 * 1e7 / 8 / h.host_bandwidth)
    # A hardware file that gives the fixed costs: today's reload (fixed + copy).
    fixed = Costs(msgspec.structs.replace(h, engine_release_s=0.5, engine_reload_s=1.0),
                  shape, Plan(shards=8))
    assert fixed.release() == 0.5
    assert fixed.reload() == pytest.approx(1.0 + copy)
    # A file written back without them still derives them (TOML has no null).
    assert "engine_reload_s" not in hardware_toml(h)
    assert "engine_reload_s = 1.0" in hardware_toml(fixed.hardware)


def config(out: Path, *, staleness: int = 1, **simulate_: object) -> Config:
    """The stages' small run, time-shared; the fixed refit costs, when given, as the
    hardware's."""
    overrides = {k: simulate_.pop(k) for k in ("engine_release_s", "engine_reload_s")
                 if k in simulate_}
    return stages_config(out, staleness=staleness, run={"colocate": "time"},
                         hardware_overrides=overrides, **simulate_)


def stats(out: Path) -> SimStats:
    return msgspec.json.decode((out / SIM_STATS).read_bytes(), type=SimStats)


def test_a_time_shared_run_pays_the_derived_turn_and_shows_it(tmp_path: Path) -> None:
    cfg = config(tmp_path / "derived")
    costs = simulation_costs(cfg)
    h = costs.hardware
    assert costs.plan.refit_offload == "optimizer" and costs.plan.sleep_level == 2
    assert costs.release() == pytest.approx(12 * 4e8 / 2 / h.host_bandwidth)
    derived = simulate(cfg)
    shared = stats(tmp_path / "derived")
    assert shared.releases == 2 * 4
    assert shared.refit["release"] == pytest.approx(costs.release())
    assert shared.refit["reload"] == pytest.approx(costs.reload())
    assert set(shared.refit) == {"release", "reload", "engine_offload", "trainer_onload",
                                 "trainer_offload", "reshard", "engine_onload", "copy"}
    assert shared.recompute_s > 0  # sequences kept across a turn recompute their KV
    console = Console(width=200, record=True)
    console.print(result_table(tmp_path / "derived", []))
    text = console.export_text()
    assert f"release {costs.release():.2f} s (trainer in {costs.release():.2f})" in text
    assert "reshard" in text and "KV recomputed" in text
    # The same run with fixed costs of 0: faster, nothing recomputed, "given" shown.
    free = simulate(config(tmp_path / "given", engine_release_s=0.0, engine_reload_s=0.0))
    assert free.wall_s < derived.wall_s
    given = stats(tmp_path / "given")
    assert given.recompute_s == 0.0
    assert set(given.refit) == {"release", "reload", "copy"}
    console = Console(width=200, record=True)
    console.print(result_table(tmp_path / "given", []))
    assert "release 0.00 s (given) + reload 0.00 s (given, copy 0.00)" in (
        console.export_text())
    # Nothing offloaded, weights discarded: the release moves nothing.
    simulate(config(tmp_path / "none", refit_offload="none"))
    console = Console(width=200, record=True)
    console.print(result_table(tmp_path / "none", []))
    assert "release 0.00 s (nothing moved) + reload" in console.export_text()


def test_more_offloaded_means_a_slower_turn_and_the_keys_are_checked(
        tmp_path: Path) -> None:
    none = simulation_costs(config(tmp_path, refit_offload="none"))
    optimizer = simulation_costs(config(tmp_path))
    every = simulation_costs(config(tmp_path, refit_offload="all", sleep_level=1))
    assert none.release() == 0.0 < optimizer.release() < every.release()
    assert none.reload() < optimizer.reload() < every.reload()
    adafactor = simulation_costs(config(tmp_path, optimizer_bytes_per_parameter=4.0))
    assert adafactor.release() == pytest.approx(optimizer.release() / 3)
    with pytest.raises(msgspec.ValidationError):
        config(tmp_path, refit_offload="optimiser")
    with pytest.raises(msgspec.ValidationError):
        config(tmp_path, sleep_level=3)
