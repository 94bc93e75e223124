"""The tunable keys: bounds from the config's rules, --allow parsing, ladders, applying."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from async_rl import knobs
from async_rl.config import Config
from async_rl.config_io import decode_config, load_config
from async_rl.sim.hardware_file import load_hardware
from async_rl.sim.run import simulation_plan
from buffers.common.config import ConfigError


def _cpu() -> Config:
    return load_config("examples/cpu_default.toml")


def _cluster(workers: int = 8, shards: int = 8) -> Config:
    return decode_config({"model": {"path": "m"},
                          "rollout": {"num_workers": workers},
                          "trainer": {"num_shards": shards, "groups_per_step": 8},
                          "simulate": {"hardware": "h100"}})


def test_default_ranges_leave_the_guarded_keys_and_stay_under_the_staleness_ceiling() -> None:
    config = _cpu()
    ranges = knobs.default_ranges(config)
    assert set(ranges) == {"rollout.max_inflight_prompts", "queue.max_groups",
                           "trainer.micro_batch_tokens", "staleness.max_staleness",
                           "weights.sync_every", "weights.update_mode"}
    assert ranges["staleness.max_staleness"] == (0, config.staleness.max_staleness)
    lo, _ = ranges["queue.max_groups"]
    assert lo == config.trainer.groups_per_step  # a step must fit the queue


@pytest.mark.parametrize(("item", "names"), [
    ("model.path", "--allow model.path: not a tunable key"),
    ("trainer.loss", "--allow trainer.loss: not a tunable key"),
    ("queue.max_groups=1..8", "queue.max_groups may only be"),
    ("staleness.max_staleness=0..99", "staleness.max_staleness may only be 0..64"),
    ("rollout.max_inflight_prompts=8", "expected rollout.max_inflight_prompts=LO..HI"),
    ("rollout.max_inflight_prompts=9..3", "with LO <= HI"),
    ("trainer.lr=a..b", "expected trainer.lr=LO..HI with float bounds"),
    ("weights.update_mode=sideways", "'sideways' is not one of"),
    ("split=1..2", "on CPU the split is rollout.cpus_per_worker and trainer.cpus_per_shard"),
])
def test_a_bad_allow_is_one_config_error_naming_the_key(item: str, names: str) -> None:
    with pytest.raises(ConfigError, match="config error: --allow ") as err:
        knobs.allowed_ranges([item], _cpu())
    assert names in str(err.value)
    assert "\n" not in str(err.value)


def test_allow_adds_guarded_keys_and_lifts_the_staleness_ceiling_only_when_named() -> None:
    config = _cpu()
    ranges = knobs.allowed_ranges(["staleness.max_staleness=1..4", "trainer.groups_per_step",
                                   "split"], config)
    assert ranges["staleness.max_staleness"] == (1, 4)
    assert ranges["trainer.groups_per_step"] == (1, config.queue.max_groups)
    assert ranges["rollout.cpus_per_worker"][0] == 1  # on CPU the split is the cores
    assert "split" not in ranges


def test_the_cluster_split_trades_whole_workers_across_a_fixed_device_count() -> None:
    config = _cluster(workers=512, shards=512)
    span = knobs.allowed_ranges(["split"], config)["split"]
    values = knobs.ladder("split", span, knobs.value_of(config, "split"))
    assert len(values) == 15
    assert values[0] == 64 and values[-1] == 960
    moved = knobs.with_values(config, {"split": 64})
    assert moved.rollout.num_workers == 64
    assert moved.trainer.num_shards == 960
    assert knobs.split_total(moved) == 1024


def test_the_split_counts_each_worker_as_its_layout_spans_devices() -> None:
    """An engine of tp 4 x pp 2 is 8 devices, a trainer replica of tp 2 x cp 2 is 4,
    as the simulator counts them: 16 engines and 8 replicas are a 160-device split."""
    raw = {"model": {"path": "m"}, "rollout": {"num_workers": 16},
           "trainer": {"num_shards": 8, "groups_per_step": 8},
           "simulate": {"hardware": "h100", "rollout_layout": {"tp": 4, "pp": 2},
                        "trainer_layout": {"tp": 2, "cp": 2, "ep": 2}}}
    config = decode_config(raw)
    assert (knobs.rollout_devices(config), knobs.trainer_devices(config)) == (128, 32)
    plan = simulation_plan(config, load_hardware("h100"))
    assert (plan.rollout.devices, plan.trainer.devices) == (8, 4)  # the simulator's
    moved = knobs.with_values(config, {"split": 64})  # 8 engines, 24 replicas
    assert (moved.rollout.num_workers, moved.trainer.num_shards) == (8, 24)
    assert knobs.split_total(moved) == 160
    # Only ep (or dp) given: a replica is one device, as the simulator lays it out.
    only_ep = {**raw["simulate"], "trainer_layout": {"ep": 2}}
    assert knobs.trainer_devices(decode_config({**raw, "simulate": only_ep})) == 8
    unlaid = {**raw["simulate"], "rollout_layout": {}, "trainer_layout": {},
              "hardware_overrides": {"devices_per_rollout_worker": 2}}
    assert knobs.split_total(decode_config({**raw, "simulate": unlaid})) == 16 * 2 + 8


def test_a_split_leaving_no_device_is_refused() -> None:
    with pytest.raises(ConfigError, match="split = 2: leaves no devices for training"):
        knobs.with_values(_cluster(workers=1, shards=1), {"split": 2})


def test_with_values_checks_the_configs_rules() -> None:
    with pytest.raises(ConfigError, match=r"queue\.max_groups"):
        knobs.with_values(_cpu(), {"queue.max_groups": 1})
    tuned = knobs.with_values(_cpu(), {"rollout.max_inflight_prompts": 48,
                                       "weights.update_mode": "drain"})
    assert tuned.rollout.max_inflight_prompts == 48
    assert tuned.weights.update_mode == "drain"


def test_live_keys_are_the_autopilots() -> None:
    assert knobs.LIVE_KEYS == ("rollout.max_inflight_prompts", "queue.max_groups",
                               "trainer.micro_batch_tokens", "staleness.max_staleness")


@given(lo=st.integers(1, 5000), width=st.integers(0, 5000), around=st.integers(1, 10000))
def test_a_ladder_stays_in_its_range_sorted_and_holds_both_ends(lo: int, width: int,
                                                                around: int) -> None:
    values = knobs.ladder("queue.max_groups", (lo, lo + width), around)
    assert len(values) >= 1
    assert values == sorted(set(values))
    assert values[0] == lo and values[-1] == lo + width
    assert all(lo <= v <= lo + width for v in values)
    if lo <= around <= lo + width:
        assert around in values
