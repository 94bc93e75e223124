"""The engines ``[autopilot]`` may add to a real run, without Ray: autopilot.max_rollout_workers
(its bounds, exit 2 in one line naming it), the cores of the engines added (spare ones
first, then the trainer's), the roster's room for them in a local Ray, what a cluster
cannot hold, and the reason a removed engine's calls fail with."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import ray

from async_rl.cli import main
from async_rl.config import Config
from async_rl.config_io import decode_config
from async_rl.control.autopilot import ENGINES, INFLIGHT, QUEUE, Autopilot, Rule
from async_rl.control.failures import RolloutFailed
from async_rl.control.live_tuning import LiveTuning
from async_rl.control.protocols import HandsBack, RolloutClient
from async_rl.control.rollout_pool import RolloutPool
from async_rl.control.step_metrics import StepTotals
from async_rl.roster import Bundle, roster
from async_rl.run.run_dir import RunWriter
from async_rl.shell.adapters import RayRollout
from async_rl.shell.lending import LEAVING, _Lent
from buffers.common.config import ConfigError
from buffers.queue.replay_queue import ReplayQueue
from buffers.queue.staleness import AdmissionGate
from workers.layout import assign_cpus, lendable_identities
from workers.placement import check_lendable

KEY = "autopilot.max_rollout_workers"


def _config(most: int, *, enabled: bool = True, **sections: dict[str, Any]) -> Config:
    return decode_config({"model": {"path": "m"}, **sections,
                          "autopilot": {"enabled": enabled, "max_rollout_workers": most}})


def test_the_key_defaults_to_no_engine_added_and_counts_the_engines_beyond() -> None:
    config = decode_config({"model": {"path": "m"}, "autopilot": {"enabled": True}})
    assert config.autopilot.max_rollout_workers == -1 and config.lendable_engines == 0
    assert _config(1).lendable_engines == 0  # rollout.num_workers itself: none added
    assert _config(3).lendable_engines == 2
    assert _config(5, rollout={"num_workers": 2}).lendable_engines == 3
    assert _config(3, enabled=False).lendable_engines == 0  # without [autopilot]: none


@pytest.mark.parametrize(("most", "sections", "says"), [
    (0, {}, "must be >= rollout.num_workers (1)"),
    (2, {"rollout": {"num_workers": 3}}, "must be >= rollout.num_workers (3)"),
    (2, {"run": {"colocate": True}}, "not with run.colocate = true"),
    (2, {"run": {"colocate": "time"}}, 'not with run.colocate = "time"'),
])
def test_a_bad_value_is_refused_naming_the_key(most: int, sections: dict[str, Any],
                                               says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{KEY} = {most}: {says}")):
        _config(most, **sections)


def test_a_bad_value_exits_2_in_one_line_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "job.toml"
    cfg.write_text('[model]\npath = "not-needed"\n[simulate]\nparameters = 5e6\n'
                   'kv_bytes_per_token = 4096\n')
    out = json.dumps(str(tmp_path / "run"))
    for setting in (f"{KEY}=0", f"{KEY}=-2"):
        assert main(["simulate", str(cfg), "--set", setting,
                     "--set", f"run.output_dir={out}"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and KEY in lines[0], lines


def test_added_engines_take_spare_cores_first_then_the_trainers() -> None:
    layout = assign_cpus(1, 1, 1, 1, available=(0, 1, 2, 3))  # rollout 0, trainer 1
    engines, room = lendable_identities(layout, (), 1, 4, 1, available=(0, 1, 2, 3))
    assert [(e.rank, e.devices) for e in engines] == [(1, (2,)), (2, (3,)), (3, (1,)),
                                                      (4, (2,))]
    assert room == 3  # two spare cores and the trainer's
    # Two cores, one each for the standing roles: an added engine shares the trainer's.
    layout = assign_cpus(1, 1, 1, 1, available=(0, 1))
    engines, room = lendable_identities(layout, (), 1, 1, 1, available=(0, 1))
    assert [(e.rank, e.devices) for e in engines] == [(1, (1,))] and room == 1
    # Two cores each: a spare core and the trainer's make one engine.
    layout = assign_cpus(1, 1, 1, 1, available=(0, 1, 2))
    engines, room = lendable_identities(layout, (), 1, 1, 2, available=(0, 1, 2))
    assert [e.devices for e in engines] == [(2, 1)] and room == 1
    assert lendable_identities(layout, (), 1, 0, 1, available=(0, 1, 2)) == ((), 2)


def test_the_roster_holds_room_for_the_added_engines_in_a_local_ray() -> None:
    plan = roster(_config(3), available=(0, 1, 2, 3))
    assert [(e.name, e.devices, e.cpus) for e in plan.lendable] == [
        ("rollout-1", (2,), 1), ("rollout-2", (3,), 1)]
    assert [e.bundle for e in plan.lendable] == [Bundle(group="lendable", index=0),
                                                 Bundle(group="lendable", index=1)]
    assert all(e.name not in {n.name for n in plan.entries} for e in plan.lendable)
    assert plan.cpus == 4 and plan.lendable_room == 3  # 1 + 1 standing, 2 to add
    without = roster(_config(3, enabled=False), available=(0, 1, 2, 3))
    assert without.lendable == () and without.cpus == 2


def test_what_a_cluster_cannot_hold_is_refused_in_one_line_naming_the_key() -> None:
    check_lendable(3, 2, 2, 0.0, needed=2)  # CPU: room for both
    check_lendable(3, 2, 0, 4.0, needed=2)  # GPUs: one each, four in all
    with pytest.raises(ConfigError, match=f"^config error: {KEY} = 4: 3 engine"):
        check_lendable(4, 3, 2, 0.0, needed=2)
    with pytest.raises(ConfigError, match=f"^config error: {KEY} = 3: 2 engine.*has 3$"):
        check_lendable(3, 2, 9, 3.0, needed=2)


def test_a_removed_engines_calls_fail_with_its_reason_and_it_is_gone() -> None:
    config = _config(2)
    worker = RayRollout("rollout-1", handle=None, config=config)
    died = ray.exceptions.RayActorError()
    before = worker._failed(died, "generate_group_ref")
    assert isinstance(before, RolloutFailed) and before.reason == "RayActorError"
    worker.leaving = LEAVING
    for err in (died, ray.exceptions.RayTaskError("generate_group_ref", "", ValueError())):
        failed = worker._failed(err, "generate_group_ref")
        assert isinstance(failed, RolloutFailed)
        assert (failed.reason, failed.worker_gone) == (LEAVING, True)
    assert msgspec.structs.asdict(config.autopilot)["max_rollout_workers"] == 2


# ---- the live tuning's engine moves --------------------------------------------------------


class FakeLending:
    """Engines 1..2 to add; rank 2's start fails."""

    engines = (1, 3)
    devices_per_engine = 1
    trainer_devices = 0

    def __init__(self, now: list[float]) -> None:
        self.now = now
        self.added: list[int] = []
        self.removed: list[int] = []

    async def add(self, rank: int) -> RolloutClient:
        if rank == 2:
            raise RolloutFailed("no answer to start", worker_gone=True)
        self.added.append(rank)
        self.now[0] += 30.0  # its start
        return f"w{rank}"  # type: ignore[return-value]

    async def remove(self, rank: int) -> None:
        self.removed.append(rank)


def test_engine_moves_join_and_leave_the_pool_and_their_switch_is_in_no_window(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = decode_config({
        "model": {"path": "m"}, "rollout": {"max_inflight_prompts": 1},
        "queue": {"max_groups": 16}, "trainer": {"groups_per_step": 4},
        "run": {"output_dir": str(tmp_path)},
        "autopilot": {"enabled": True, "every_steps": 1, "keys": [],
                      "max_rollout_workers": 3}})
    now = [0.0]
    lending = FakeLending(now)

    async def run() -> None:
        pool = RolloutPool({0: "w0"}, limit=1, max_restarts=0,  # type: ignore[dict-item]
                           totals=StepTotals(bucket_edges=()), restart=None,
                           current_policy=None, exit_wait_s=1.0)  # type: ignore[arg-type]
        queue: ReplayQueue[Any] = ReplayQueue.from_config(config.queue, config.staleness)
        gate = AdmissionGate.from_config(config.staleness, groups_per_step=4)
        tuning = LiveTuning(config, RunWriter(tmp_path, config), pool=pool, queue=queue,
                            gate=gate, clock=lambda: now[0], lending=lending)
        assert tuning.columns() == {f"autopilot/{ENGINES}": 1}

        async def step(number: int, wait_s: float, took_s: float = 1.0) -> None:
            now[0] += took_s
            await tuning.after_step(number, 4, [], wait_s=wait_s, tokens=400)

        await step(1, 0.9)  # the fill: no window
        group = msgspec.defstruct("G", [("prompt_id", str), ("min_version", int),
                                        ("num_tokens", int)], frozen=True)
        for index in range(6):  # what the standing engine queues during the switch
            assert queue.put_nowait(group(str(index), 0, 1))
        await step(2, 0.9)  # starved: every engine it may add, the start of rank 2 failing
        assert tuning.columns() == {f"autopilot/{ENGINES}": 3}
        assert lending.added == [1] and sorted(pool.workers) == [0, 1]
        assert "rollout-2 was not added: no answer to start" in caplog.text
        assert "moved in 30.0 s; the next 2 step(s)" in caplog.text
        # The 6 groups queued make 2 steps in no window, however fast they train.
        assert tuning.autopilot is not None
        windows = tuning.autopilot.windows
        await step(3, 0.0, 0.1)
        await step(4, 0.0, 0.1)
        assert tuning.autopilot.windows == windows
        assert tuning.autopilot.changes[0].outcome == "pending"
        await step(5, 0.9, 1.0)  # the window after the switch: as fast as before, kept
        assert tuning.autopilot.windows == windows + 1
        assert tuning.autopilot.changes[0].outcome == "kept"
        assert tuning.autopilot.changes[0].judged_step == 5

    with caplog.at_level(logging.INFO, logger="async_rl.control.live_tuning"):
        anyio.run(run)


def test_the_queues_room_counts_the_engines_running_now() -> None:
    config = decode_config({
        "model": {"path": "m"}, "rollout": {"max_inflight_prompts": 1},
        "queue": {"max_groups": 20}, "trainer": {"groups_per_step": 16},
        "autopilot": {"enabled": True, "max_rollout_workers": 3}})
    pilot = Autopilot(config, FakeLending([0.0]))
    starved = Rule(0.5, INFLIGHT, 1, "starved", 2.0)
    # One engine at 2 in flight: 16 + 2 fit a queue of 20.
    assert pilot._room_first(starved, "starved").key == INFLIGHT
    pilot.values[ENGINES] = 3  # three: 16 + 6 do not
    rise = pilot._room_first(starved, "starved")
    assert rise.key == QUEUE and "the 6 prompts" in rise.cause


def test_an_added_engines_client_counts_its_calls_and_hands_back() -> None:
    release = [anyio.Event()]

    class Worker:
        name = "rollout-1"

        async def generate(self, prompt: Any) -> Any:
            await release[0].wait()
            return prompt

        async def continue_group(self, partial: Any) -> Any:
            return partial

        async def hand_back(self) -> int:
            return 2

    async def run() -> None:
        lent = _Lent(Worker())  # type: ignore[arg-type]
        assert isinstance(lent, HandsBack) and lent.name == "rollout-1"
        await lent.drained()  # no call: at once
        done: list[Any] = []
        async with anyio.create_task_group() as calls:
            for prompt in ("a", "b"):
                calls.start_soon(lambda p=prompt: _append(done, lent.generate(p)))
            await anyio.sleep(0.01)
            assert lent.calls == 2 and await lent.hand_back() == 2
            with anyio.move_on_after(0.05) as waited:
                await lent.drained()
            assert waited.cancelled_caught  # calls in progress
            release[0].set()
            await lent.drained()
        assert sorted(done) == ["a", "b"] and lent.calls == 0
        assert await lent.continue_group("p") == "p"

    anyio.run(run)


async def _append(into: list[Any], call: Any) -> None:
    into.append(await call)
