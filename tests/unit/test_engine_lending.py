"""The engines ``[autopilot]`` may add to a real run, without Ray: autopilot.max_rollout_workers
(its bounds, exit 2 in one line naming it), the cores of the engines added (spare ones
first, then the trainer's), the roster's room for them in a local Ray, what a cluster
cannot hold, and the reason a removed engine's calls fail with."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import ray

from async_rl.cli import main
from async_rl.config import Config
from async_rl.config_io import decode_config
from async_rl.control.protocols import RolloutFailed
from async_rl.roster import Bundle, roster
from async_rl.shell.adapters import RayRollout
from async_rl.shell.lending import LEAVING
from buffers.common.config import ConfigError
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
