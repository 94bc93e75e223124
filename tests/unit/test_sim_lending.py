"""Devices lent between the roles (simulate.lend): the switch's cost against a hand
computation from bytes and bandwidth, a starved trainer lending and a full step's
groups taking the devices back, the autopilot's engine count (``balanced_engines`` by
hand, its rule on synthetic windows, a simulated run that adds engines), the pool's
join and leave, the degenerate setups (nothing to lend, one device, lending off) and the
config errors, each exiting 2 in one line naming its key."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import msgspec
import pytest
from rich.console import Console
from test_autopilot import _config as autopilot_config
from test_autopilot import _window
from test_sim_version_stages import config as small_config

from async_rl.analysis.results import SIM_STATS, LendRecord, SimStats, result_table
from async_rl.api import simulate
from async_rl.cli import main
from async_rl.config import Config
from async_rl.control.autopilot import ENGINES, Autopilot, balanced_engines
from async_rl.control.rollout_pool import RolloutPool
from async_rl.control.step_metrics import StepTotals
from async_rl.run.run_dir import read_metrics, read_record
from async_rl.sim.engine import SimEngine
from async_rl.sim.lending import SimLending, lend_plan
from async_rl.sim.run import simulation_costs
from buffers.common.config import ConfigError


def config(out: Path, *, steps: int = 8, inflight: int = 2, autopilot: dict[str, object]
           | None = None, **simulate_: object) -> Config:
    """The small long-tail run of 2 one-device engines and 2 one-device shards, made
    generation-bound (2 prompts in flight an engine, staleness 4)."""
    cfg = small_config(out, staleness=4, run={"num_steps": steps}, **simulate_)
    return msgspec.structs.replace(
        cfg, rollout=msgspec.structs.replace(cfg.rollout, max_inflight_prompts=inflight),
        autopilot=msgspec.convert(autopilot or {}, type(cfg.autopilot)))


def lent(out: Path) -> LendRecord | None:
    return msgspec.json.decode((out / SIM_STATS).read_bytes(), type=SimStats).lend


def shown(out: Path) -> str:
    console = Console(width=400, record=True)
    console.print(result_table(out, []))
    return console.export_text()


# ---- the switch's cost --------------------------------------------------------------------


def test_a_switch_costs_a_refits_reload_out_and_its_release_back(tmp_path: Path) -> None:
    costs = simulation_costs(config(tmp_path, lend="starvation"))
    h = costs.hardware
    assert h.devices_per_trainer_shard == h.devices_per_rollout_worker == 1
    # 4e8 parameters in float32 (1.6e9 bytes), Adam's 12 bytes each (4.8e9) over the
    # trainer's 2 devices, each over its own 64 GB/s host link.
    assert costs.model.bytes_per_parameter == 4
    optimizer = 12 * 4e8 / 2 / h.host_bandwidth
    assert h.host_bandwidth == 64e9 and optimizer == pytest.approx(0.0375)
    # Out: the lent devices' optimizer state to host, the weights gathered from the 2
    # holders into the engine's layout (half of them over NVLink at 450 GB/s, plus its
    # latency), the version copied at the device's achieved memory bandwidth.
    reshard = 0.5 * 1.6e9 / 450e9 + 1e-5
    copy = 1.6e9 / (3.35e12 * 0.7)
    assert (h.intra_node_bandwidth, h.memory_bandwidth, h.memory_efficiency) == (
        450e9, 3.35e12, 0.7)
    assert costs.reload() == pytest.approx(optimizer + reshard + copy)
    assert costs.reload() == pytest.approx(0.0375 + 0.0017878 + 0.0006823, rel=1e-4)
    assert costs.release() == pytest.approx(optimizer)  # back: the state returns
    simulate(config(tmp_path, lend="starvation", lend_wait=0.0))
    record = lent(tmp_path)
    assert record is not None and record.lends >= 2
    assert record.lend_s == pytest.approx(costs.reload())
    assert record.return_s == pytest.approx(costs.release())
    # The trainer waits on each return (and a lend under way): at least its release.
    assert record.switch_s >= record.returns * costs.release() - 1e-9
    assert record.switch_s <= record.returns * (costs.release() + costs.reload()) + 0.05


# ---- "starvation" ------------------------------------------------------------------------


def test_a_starved_trainer_lends_its_devices_and_takes_them_back_for_each_step(
        tmp_path: Path) -> None:
    off = simulate(config(tmp_path / "off"))
    assert lent(tmp_path / "off") is None
    assert "lent devices" not in shown(tmp_path / "off")
    on = simulate(config(tmp_path / "on", lend="starvation"))
    record = lent(tmp_path / "on")
    assert record is not None and record.arm == "starvation"
    assert record.engines == 2 and record.devices_per_engine == 1
    assert record.lends >= 2 and record.engines_lent == 2 * record.lends
    # Every lend comes back before the next step trains (the last may outlive the run).
    assert record.returns in (record.lends, record.lends - 1)
    assert 0 < record.device_s < 2 * on.wall_s
    # Requests on lent devices when they went back resumed with the tokens they made.
    assert record.moved > 0 and record.moved_tokens > 0
    assert on.groups_trained == off.groups_trained == 8 * 8  # nothing lost
    assert on.groups_per_s > 1.1 * off.groups_per_s  # generation-bound: lending pays
    text = shown(tmp_path / "on")
    assert f"starvation: {record.lends} lends, {record.returns} returns" in text
    assert f"a switch {record.lend_s:.2f} s out, {record.return_s:.2f} s back" in text


def test_a_trainer_that_never_waits_lends_nothing(tmp_path: Path) -> None:
    # Training 1,000 times slower: the queue holds a step's groups whenever one ends.
    simulate(config(tmp_path, lend="starvation", hardware_overrides={"train_mfu": 0.0005}))
    record = lent(tmp_path)
    assert record is not None and record.lends == record.returns == 0
    assert record.device_s == 0.0 and record.moved == 0


def test_a_wait_below_lend_wait_lends_nothing_but_the_pipeline_fill(tmp_path: Path) -> None:
    # Before step 1 the trainer waited its whole time: only then is lend_wait = 1 met.
    simulate(config(tmp_path, lend="starvation", lend_wait=1.0))
    record = lent(tmp_path)
    assert record is not None and record.lends == 1 and record.returns == 1


# ---- "autopilot" -------------------------------------------------------------------------


def test_balanced_engines_by_hand() -> None:
    # 64 engines of 8 devices, a trainer of 512, generation 3.5x the trainer's time:
    # k = 64 x 512 x 2.5 / (512 + 3.5 x 64 x 8) = 81,920 / 2,304 = 35.56 engines more.
    assert balanced_engines(64, 3.5, 8, 512) == pytest.approx(64 + 81920 / 2304)
    assert balanced_engines(64, 3.5, 8, 0) == pytest.approx(224)  # spare devices
    # Generation 0.88 of the trainer's time: 37 x 27 x -0.12 / (27 + 0.88 x 37) = -2.01.
    assert balanced_engines(37, 0.88, 1, 27) == pytest.approx(37 - 119.88 / 59.56)
    assert balanced_engines(10, 1.0, 4, 40) == 10  # balanced already


class _Lending:
    """Engines 1..5 of 2 devices each, from a trainer of 16 (``EngineLending``)."""

    engines = (1, 5)
    devices_per_engine = 2
    trainer_devices = 16


def test_a_starved_trainer_adds_engines_after_the_free_keys_and_a_full_queue_gives_back(
        ) -> None:
    alone = Autopilot(autopilot_config(keys=[]), _Lending())  # type: ignore[arg-type]
    assert alone.values == {ENGINES: 1} and alone.rungs[ENGINES] == [1, 2, 3, 4, 5]
    # Waiting half the window: generation takes 2x the trainer's time; one engine of 2
    # devices from 16: k = 1 x 16 x 1 / (16 + 2 x 1 x 2) = 0.8, so 1.8: the rung 2.
    move = alone.observe(_window(5, trainer_wait_data=0.5))
    assert move is not None and (move.key, move.old, move.new) == (ENGINES, 1, 2)
    assert "about 2 engines balance" in move.cause and "the trainer's 16" in move.cause
    alone.observe(_window(10, 2.0, trainer_wait_data=0.5))  # kept; k from 2 on 14 devices: 2 + 1.56
    assert alone.values[ENGINES] == 4
    # A trainer that never waits while rollout waits on a full queue 40% of the window:
    # 4 x 10 x -0.4 / (10 + 0.6 x 4 x 2) = -1.08, the rung at or below 2.92: 2.
    alone.observe(_window(15, 2.5))  # the move judged (kept), nothing to do
    back = alone.observe(_window(20, 2.5, rollout_queue_full=0.4))
    assert back is not None and (back.key, back.old, back.new) == (ENGINES, 4, 2)
    # With the prompts in flight a key too, they move first (they cost no devices).
    both = Autopilot(autopilot_config(), _Lending())  # type: ignore[arg-type]
    first = both.observe(_window(5, trainer_wait_data=0.5))
    assert first is not None and first.key == "rollout.max_inflight_prompts"


def test_no_lending_or_nothing_to_lend_makes_no_engine_key() -> None:
    assert ENGINES not in Autopilot(autopilot_config()).values

    class Nothing(_Lending):
        engines = (1, 1)

    none = Autopilot(autopilot_config(keys=[]), Nothing())  # type: ignore[arg-type]
    assert none.values == {} and none.observe(_window(5, trainer_wait_data=0.5)) is None


def test_the_autopilot_adds_lent_engines_to_a_simulated_run_and_says_so(
        tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=12, lend="autopilot",
                 hardware_overrides={"devices_per_trainer_shard": 4},
                 autopilot={"enabled": True, "keys": [], "every_steps": 2})
    assert lend_plan(cfg, simulation_costs(cfg)) == (4, 1, 8)  # 8 devices, 4 kept
    summary = simulate(cfg)
    record_ = read_record(tmp_path)
    assert record_ is not None
    changes = record_.autopilot
    assert changes and all(c.key == ENGINES for c in changes)
    assert changes[0].old == 2 and changes[0].new > 2
    record = lent(tmp_path)
    assert record is not None and record.engines_lent >= changes[0].new - 2
    assert record.device_s > 0 and record.switch_s == pytest.approx(
        record.lends * record.lend_s + record.returns * record.return_s)
    rows = read_metrics(tmp_path)
    # A change after the last step applies to no row.
    last = [c for c in changes if c.step < 12][-1]
    assert len(rows) == 12 and rows[-1][f"autopilot/{ENGINES}"] == (
        last.old if last.outcome == "reverted" and last.judged_step < 12 else last.new)
    assert summary.groups_trained == 12 * 8


def test_a_trainer_lending_to_the_autopilot_trains_on_the_devices_left(
        tmp_path: Path) -> None:
    cfg = config(tmp_path, lend="autopilot", hardware_overrides={
        "devices_per_trainer_shard": 4}, autopilot={"enabled": True, "keys": []})
    costs = simulation_costs(cfg)
    engines = {rank: SimEngine(rank, costs, lambda: 0.0) for rank in range(2)}
    lending = SimLending(cfg, costs, lambda: 0.0, engines, None,
                         lambda rank, engine, fallback: None)  # type: ignore[arg-type,return-value]
    assert lending.engines == (2, 6) and sorted(engines) == [0, 1, 2, 3, 4, 5]
    assert lending.compute_factor() == 1.0
    lending.lent = {2: 0.0, 3: 0.0}  # 2 one-device engines of the trainer's 8
    assert lending.compute_factor() == pytest.approx(8 / 6)
    starved = SimLending(msgspec.structs.replace(cfg, simulate=msgspec.structs.replace(
        cfg.simulate, lend="starvation")), costs, lambda: 0.0, engines, None,
        lambda rank, engine, fallback: None)  # type: ignore[arg-type,return-value]
    starved.lent = {6: 0.0}
    assert starved.compute_factor() == 1.0  # lent only while the trainer waits


def test_engines_from_spare_devices_leave_the_trainer_whole(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=12, lend="autopilot", spare_devices=4,
                 autopilot={"enabled": True, "keys": [], "every_steps": 2})
    costs = simulation_costs(cfg)
    assert lend_plan(cfg, costs) == (4, 1, 2)  # the 4 spare devices, not the trainer's 2
    # An engine on a spare device receives the version as a broadcast to one receiver
    # and loads it; given back, it frees its memory (nothing moves).
    start = costs.transfer(1, 16 << 20) + costs.load()
    assert cfg.weights.bucket_mb == 16 and start > 0
    engines = {rank: SimEngine(rank, costs, lambda: 0.0) for rank in range(2)}
    lending = SimLending(cfg, costs, lambda: 0.0, engines, None,
                         lambda rank, engine, fallback: None)  # type: ignore[arg-type,return-value]
    assert (lending.trainer_devices, lending.lend_s, lending.return_s) == (0, start, 0.0)
    lending.lent = {2: 0.0, 3: 0.0}
    assert lending.compute_factor() == 1.0
    simulate(cfg)
    record_ = read_record(tmp_path)
    assert record_ is not None and record_.autopilot
    first = record_.autopilot[0]
    assert first.key == ENGINES and first.new > 2 and "from spare devices" in first.cause
    record = lent(tmp_path)
    assert record is not None and record.spare_devices == 4 and record.engines_lent >= 1
    assert record.lend_s == pytest.approx(start) and record.return_s == 0.0
    assert "of the spare); a switch" in shown(tmp_path)


# ---- the pool ----------------------------------------------------------------------------


def test_the_pool_takes_a_joining_worker_and_gives_no_prompt_to_one_that_left() -> None:
    async def run() -> None:
        pool = RolloutPool({0: "w0"}, limit=1, max_restarts=0,  # type: ignore[dict-item]
                           totals=StepTotals(bucket_edges=()), restart=None,
                           current_policy=None, exit_wait_s=1.0)  # type: ignore[arg-type]
        assert await pool.acquire(lambda: None) == (0, "w0")
        assert pool.full()
        await pool.join(5, "w5")  # type: ignore[arg-type]
        assert len(pool) == 2 and await pool.acquire(lambda: None) == (5, "w5")
        assert pool.leave(5) == "w5" and len(pool) == 1
        await pool.release(5)  # its call ends after it left: the slot comes back
        await pool.release(0)
        assert await pool.acquire(lambda: None) == (0, "w0")
        await pool.join(5, "w5")  # type: ignore[arg-type]
        assert await pool.acquire(lambda: None) == (5, "w5")

    anyio.run(run)


# ---- degenerate setups and bad input ------------------------------------------------------


def test_nothing_to_lend_runs_as_off_and_says_why(tmp_path: Path) -> None:
    # A trainer of 1 device, engines of 2: no engine to spare.
    cfg = small_config(tmp_path / "none", lend="starvation", run={"num_steps": 3},
                       hardware_overrides={"devices_per_rollout_worker": 2})
    cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(
        cfg.trainer, num_shards=1))
    simulate(cfg)
    record = lent(tmp_path / "none")
    assert record is not None and record.engines == 0 and record.lends == 0
    assert "nothing to lend (the trainer's 1 device(s) make no engine of 2" in shown(
        tmp_path / "none")


def test_one_device_is_lent_whole_by_starvation_but_kept_by_the_autopilot(
        tmp_path: Path) -> None:
    cfg = config(tmp_path, lend="starvation")
    one = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer,
                                                                       num_shards=1))
    assert lend_plan(one, simulation_costs(one)) == (1, 1, 1)
    simulate(one)
    record = lent(tmp_path)
    assert record is not None and record.engines == 1 and record.lends >= 1
    auto = msgspec.structs.replace(one, simulate=msgspec.structs.replace(
        one.simulate, lend="autopilot"), autopilot=msgspec.structs.replace(
        one.autopilot, enabled=True))
    assert lend_plan(auto, simulation_costs(auto)) == (0, 1, 1)  # its one replica stays


@pytest.mark.parametrize(("setting", "names"), [
    ('simulate.lend="sometimes"', "simulate.lend"),
    ("simulate.lend_wait=1.5", "simulate.lend_wait"),
    ('simulate.lend="autopilot"', 'simulate.lend = "autopilot": the autopilot decides'),
    ("simulate.lend_engines=3", "simulate.lend_engines = 3: the trainer's 2 devices"),
    ("simulate.spare_devices=8", 'simulate.spare_devices = 8: only simulate.lend = "auto'),
])
def test_bad_lending_exits_2_in_one_line_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: str,
        names: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[model]\npath = "not-needed"\n[trainer]\nnum_shards = 2\n'
                   'groups_per_step = 8\n[simulate]\nhardware = "h100"\n'
                   'parameters = 4e8\nkv_bytes_per_token = 4096\n'
                   + ('lend = "starvation"\n' if "lend_engines" in setting else ""))
    out = json.dumps(str(tmp_path / "run"))
    assert main(["simulate", str(job), "--set", setting, "--set",
                 f"run.output_dir={out}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], lines


def test_spare_devices_fewer_than_an_engine_lend_nothing(tmp_path: Path) -> None:
    cfg = config(tmp_path, lend="autopilot", spare_devices=1, autopilot={"enabled": True},
                 hardware_overrides={"devices_per_rollout_worker": 2})
    assert lend_plan(cfg, simulation_costs(cfg))[0] == 0
    simulate(cfg)
    assert "nothing to lend (the spare 1 device(s) make no engine of 2" in shown(tmp_path)


def test_lending_beside_time_shared_devices_or_a_stop_count_is_refused(
        tmp_path: Path) -> None:
    shared = small_config(tmp_path, lend="starvation", run={"colocate": "time"})
    with pytest.raises(ConfigError, match=r'simulate\.lend = "starvation": the roles take'):
        lend_plan(shared, simulation_costs(shared))
    stop = config(tmp_path, lend="starvation", preemption_step=2)
    with pytest.raises(ConfigError, match=r"not with simulate\.preemption_step"):
        simulate(stop)
