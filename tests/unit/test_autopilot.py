"""[autopilot]: its decisions on synthetic windows, the live setters it applies them
with, its config errors, and a simulated run retuned from a poor setting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from test_simulate import config as sim_config

from async_rl import knobs
from async_rl.api import simulate
from async_rl.cli import main
from async_rl.config import AutopilotConfig, Config
from async_rl.config_io import decode_config
from async_rl.control.autopilot import (
    COOLDOWN_WINDOWS,
    MIN_BAND,
    Autopilot,
    Window,
    noise_band,
)
from async_rl.run.run_dir import read_metrics, read_record
from buffers.common.config import ConfigError
from buffers.queue.replay_queue import ReplayQueue
from buffers.queue.staleness import AdmissionGate

INFLIGHT, QUEUE = "rollout.max_inflight_prompts", "queue.max_groups"
MICRO, STALENESS = "trainer.micro_batch_tokens", "staleness.max_staleness"


def _config(queue: int = 64, **autopilot: Any) -> Config:
    """One rollout worker, 1 prompt in flight, 16-group steps, a queue of ``queue``."""
    return decode_config({"model": {"path": "m"},
                          "rollout": {"max_inflight_prompts": 1, "max_new_tokens": 256},
                          "queue": {"max_groups": queue},
                          "staleness": {"max_staleness": 2},
                          "trainer": {"groups_per_step": 16, "micro_batch_tokens": 4096},
                          "autopilot": {"enabled": True, **autopilot}})


def _window(step: int, rate: float = 1.0, *, steps: int = 5, spread: float = 0.0,
            tokens_per_group: int = 0, **shares: float) -> Window:
    """``steps`` steps of 16 groups at about ``rate`` groups/s (alternating +-spread),
    each group of ``tokens_per_group`` tokens (0: not known); shares: role_cause=share,
    e.g. trainer_wait_data=0.4."""
    rates = tuple(rate + (spread if i % 2 else -spread) for i in range(steps))
    idle: dict[str, dict[str, float]] = {}
    for name, share in shares.items():
        role, _, cause = name.partition("_")
        idle.setdefault(role, {})[cause] = share
    return Window(last_step=step, groups_per_s=rates, groups=16 * steps,
                  wall_s=16 * steps / rate, idle=idle, tokens=16 * steps * tokens_per_group)


STARVED = {"trainer_wait_data": 0.41}


def test_a_starved_trainer_raises_prompts_in_flight_one_rung_and_says_why() -> None:
    pilot = Autopilot(_config())
    move = pilot.observe(_window(5, **STARVED))
    assert move is not None and not move.revert
    assert (move.key, move.old, move.new) == (INFLIGHT, 1, 2)
    assert "trainer waited 41% of the window for data at 1 prompts in flight" in move.cause
    assert "raise rollout.max_inflight_prompts" in move.cause  # the idle report's advice
    assert pilot.values[INFLIGHT] == 2
    assert len(pilot.changes) == 1 and pilot.changes[0].outcome == "pending"


@pytest.mark.parametrize(("waits", "to"), [(0.6, 4), (0.8, 8), (0.97, 8)])
def test_a_badly_starved_trainer_raises_prompts_in_flight_as_far_as_its_wait_says(
        waits: float, to: int) -> None:
    """Waiting 60% for data: rollout must make 2.5x the groups (the rung at or above
    is 4); 80%: 5x (8); 97%: 33x, cut at MAX_JUMP (8)."""
    pilot = Autopilot(_config())
    move = pilot.observe(_window(5, trainer_wait_data=waits))
    assert move is not None and (move.key, move.old, move.new) == (INFLIGHT, 1, to)
    assert f"{min(1 / (1 - waits), 8.0):.1f}x the groups would keep it busy" in move.cause
    # A jump that slows the next window goes back where it came from.
    back = pilot.observe(_window(10, rate=0.5, trainer_wait_data=waits))
    assert back is not None and back.revert and (back.old, back.new) == (to, 1)


@pytest.mark.parametrize(("queue", "waits", "to"), [(16, 0.8, 32), (20, 0.5, 32)])
def test_a_queue_too_small_for_a_step_and_the_prompts_to_be_in_flight_rises_first(
        queue: int, waits: float, to: int) -> None:
    """Waiting 80% for data, 1 in flight would go to 8: a step's 16 groups plus 8 need
    24 > 16, so the queue rises first, to the rung at or above 24 (32); then, with room,
    the prompts in flight. Waiting 50%, 1 would go to 2: 16 + 2 fits a queue of 20, so
    the prompts rise at once."""
    pilot = Autopilot(_config(queue=queue))
    move = pilot.observe(_window(5, trainer_wait_data=waits))
    assert move is not None
    if queue == 20:
        assert (move.key, move.old, move.new) == (INFLIGHT, 1, 2)
        return
    assert (move.key, move.old, move.new) == (QUEUE, queue, to)
    assert f"a queue of {queue} cannot hold a step's 16 groups and the 8 prompts" in move.cause
    assert "raise rollout.max_inflight_prompts" in move.cause  # the wait's advice
    then = pilot.observe(_window(10, trainer_wait_data=waits))  # kept: same groups/s
    assert then is not None and (then.key, then.old, then.new) == (INFLIGHT, 1, 8)


def test_a_full_queue_while_the_trainer_waits_raises_the_queue() -> None:
    move = Autopilot(_config(queue=16)).observe(_window(5, trainer_wait_data=0.3,
                                                        rollout_queue_full=0.5))
    assert move is not None and (move.key, move.old, move.new) == (QUEUE, 16, 32)
    assert "full queue 50%" in move.cause


def test_a_trainer_bound_run_lowers_staleness_and_a_closed_gate_raises_it_to_the_ceiling(
        ) -> None:
    pilot = Autopilot(_config())
    lowered = pilot.observe(_window(5, trainer_wait_data=0.01, rollout_queue_full=0.6))
    assert lowered is not None and (lowered.key, lowered.old, lowered.new) == (STALENESS, 2, 1)
    gated = {"trainer_wait_data": 0.3, "rollout_gate_closed": 0.5}
    raised = pilot.observe(_window(10, **gated))
    assert raised is not None and (raised.key, raised.old, raised.new) == (STALENESS, 1, 2)
    # At the ceiling (staleness.max_staleness): the gate's rule can no longer move it.
    then = pilot.observe(_window(15, **gated))
    assert then is None or then.key != STALENESS
    assert pilot.values[STALENESS] <= 2


def test_shards_waiting_on_each_other_lower_the_micro_batch() -> None:
    move = Autopilot(_config()).observe(_window(5, trainer_barrier=0.3))
    assert move is not None and (move.key, move.old, move.new) == (MICRO, 4096, 2048)


def test_small_idle_shares_make_no_move() -> None:
    assert Autopilot(_config()).observe(_window(5, trainer_wait_data=0.05)) is None


def test_a_move_the_next_window_does_not_slow_is_kept() -> None:
    pilot = Autopilot(_config())
    pilot.observe(_window(5, 1.0, spread=0.1, **STARVED))
    pilot.observe(_window(10, 0.97, spread=0.1))  # within the noise band
    change = pilot.changes[0]
    assert (change.outcome, change.judged_step) == ("kept", 10)
    assert "noise band" in change.judgement and pilot.values[INFLIGHT] == 2


def test_a_move_that_slows_the_next_window_is_reverted_and_not_retried_for_a_while() -> None:
    pilot = Autopilot(_config())
    pilot.observe(_window(5, 1.0, **STARVED))
    revert = pilot.observe(_window(10, 0.5, **STARVED))
    assert revert is not None and revert.revert
    assert (revert.key, revert.old, revert.new) == (INFLIGHT, 2, 1)
    assert pilot.values[INFLIGHT] == 1
    assert pilot.changes[0].outcome == "reverted" and len(pilot.changes) == 1
    blocked = [pilot.observe(_window(10 + 5 * i, 0.5, **STARVED))
               for i in range(1, COOLDOWN_WINDOWS)]
    assert len(blocked) == COOLDOWN_WINDOWS - 1
    assert all(move is None for move in blocked)
    again = pilot.observe(_window(100, 0.5, **STARVED))
    assert again is not None and (again.key, again.new) == (INFLIGHT, 2)


def test_a_window_slower_only_because_its_groups_grew_longer_keeps_the_move() -> None:
    """Groups/s fell from 1.0 to 0.6 while the groups grew from 100 to 200 tokens: at
    the earlier lengths that is 1.2 groups/s, a gain, so the move stays."""
    pilot = Autopilot(_config())
    pilot.observe(_window(5, 1.0, tokens_per_group=100, **STARVED))
    assert pilot.observe(_window(10, 0.6, tokens_per_group=200)) is None
    change = pilot.changes[0]
    assert change.outcome == "kept" and pilot.values[INFLIGHT] == 2
    assert "groups/s 1 -> 0.6 (1.2 at the earlier window's group lengths)" in change.judgement


@pytest.mark.parametrize(("before", "after"), [(100, 100), (0, 200), (100, 0)])
def test_a_slower_window_at_the_same_or_unknown_lengths_reverts(before: int,
                                                                after: int) -> None:
    pilot = Autopilot(_config())
    pilot.observe(_window(5, 1.0, tokens_per_group=before, **STARVED))
    revert = pilot.observe(_window(10, 0.6, tokens_per_group=after))
    assert revert is not None and revert.revert and pilot.values[INFLIGHT] == 1
    assert "at the earlier window's group lengths" not in pilot.changes[0].judgement


def test_a_window_faster_only_because_its_groups_grew_shorter_is_judged_at_the_old_lengths(
        ) -> None:
    """1.0 -> 1.5 groups/s, but groups shrank from 300 to 100 tokens: 0.5 at the earlier
    lengths, a loss: reverted."""
    pilot = Autopilot(_config())
    pilot.observe(_window(5, 1.0, tokens_per_group=300, **STARVED))
    revert = pilot.observe(_window(10, 1.5, tokens_per_group=100))
    assert revert is not None and revert.revert
    assert "(0.5 at the earlier window's group lengths)" in pilot.changes[0].judgement


def test_prompts_in_flight_stop_at_the_ceiling_the_rollout_actor_is_made_for() -> None:
    config = _config()
    pilot = Autopilot(config)
    rates = [1.0 + i for i in range(20)]  # every window faster: every move is kept
    moves = [pilot.observe(_window(5 * (i + 1), rate, **STARVED)) for i, rate in
             enumerate(rates)]
    raised = [m.new for m in moves if m is not None and m.key == INFLIGHT]
    assert raised == [2, 4, 8, 16]
    assert knobs.live_range(config, INFLIGHT) == (1, 16)
    assert knobs.inflight_ceiling(config) == 16
    assert knobs.inflight_ceiling(_config(enabled=False)) == 1
    assert knobs.inflight_ceiling(_config(keys=[QUEUE])) == 1


def test_only_the_keys_named_are_turned() -> None:
    pilot = Autopilot(_config(keys=[QUEUE]))
    assert pilot.observe(_window(5, **STARVED)) is None
    assert set(pilot.values) == {QUEUE}


def test_a_window_that_trained_nothing_decides_and_judges_nothing() -> None:
    pilot = Autopilot(_config())
    pilot.observe(_window(5, **STARVED))
    empty = Window(last_step=10, groups_per_s=(), groups=0, wall_s=3.0,
                   idle={"trainer": {"wait_data": 1.0}})
    assert pilot.observe(empty) is None
    assert pilot.changes[0].outcome == "pending" and pilot.values[INFLIGHT] == 2


def test_the_noise_band_of_one_step_or_identical_steps_is_the_floor() -> None:
    one, same = _window(5, 2.0, steps=1), _window(10, 2.0)
    assert noise_band(one, one) == pytest.approx(MIN_BAND * 2.0)
    assert noise_band(same, same) == pytest.approx(MIN_BAND * 2.0)
    noisy = _window(5, 2.0, spread=0.5)
    assert noise_band(noisy, noisy) > MIN_BAND * 2.0


def test_the_default_keys_are_the_live_keys() -> None:
    assert AutopilotConfig().keys == knobs.LIVE_KEYS


@pytest.mark.parametrize(("key", "says"), [("weights.sync_every", "not a live key"),
                                           ("model.path", "not a tunable key")])
def test_a_key_that_cannot_change_live_is_refused_naming_it(key: str, says: str) -> None:
    with pytest.raises(ConfigError, match=f"autopilot.keys: '{key}' is {says}"):
        knobs.check_live(_config(keys=[key]))


def test_bad_autopilot_config_exits_2_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "job.toml"
    cfg.write_text('[model]\npath = "not-needed"\n[simulate]\nparameters = 5e6\n'
                   'kv_bytes_per_token = 4096\n')
    out = json.dumps(str(tmp_path / "run"))
    for setting, names in [("autopilot.max_staleness=3", "autopilot.max_staleness = 3"),
                           ('autopilot.keys=["weights.sync_every"]', "weights.sync_every")]:
        assert main(["simulate", str(cfg), "--set", setting,
                     "--set", f"run.output_dir={out}"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and names in lines[0], lines


async def _live_setters() -> None:
    dropped: list[Any] = []
    queue: ReplayQueue[Any] = ReplayQueue(max_groups=2, max_tokens=100, max_staleness=2,
                                          bucket_edges=(), on_drop=lambda d: dropped.append(d))

    class G(msgspec.Struct, frozen=True):
        prompt_id: str
        min_version: int
        num_tokens: int = 1

    assert await queue.put(G("old", 0)) and await queue.put(G("new", 2))
    assert queue.take_nowait(1, at_version=2) == [G("old", 0)]
    queue.resize(3)
    assert queue.put_nowait(G("a", 2)) and queue.put_nowait(G("b", 1)) and len(queue) == 3
    queue.set_max_staleness(0)  # groups older than the last take's version go, counted
    assert len(dropped) == 1 and len(queue) == 2
    assert queue.statistics().drops == {"stale": 1}
    assert not queue.put_nowait(G("late", 1))  # a late arrival too stale for the bound
    gate = AdmissionGate(groups_per_step=1, max_staleness=0)
    assert gate.try_acquire() and not gate.try_acquire()
    gate.set_max_staleness(1)
    assert gate.try_acquire()


def test_the_queue_and_gate_take_new_bounds_live_and_keep_the_staleness_rule() -> None:
    anyio.run(_live_setters)


def test_a_simulated_run_from_a_poor_setting_is_retuned_and_says_so_everywhere(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    raw = msgspec.to_builtins(sim_config(out, steps=40, max_staleness=2, hardware="cpu"))
    raw["rollout"]["max_inflight_prompts"] = 1
    raw["queue"]["max_groups"] = 8
    raw["autopilot"] = {"enabled": True}
    simulate(msgspec.convert(raw, Config))
    record = read_record(out)
    assert record is not None
    changes = record.autopilot
    # A queue of 8 cannot hold a step's groups and more prompts in flight: it rises
    # first, then the prompts in flight.
    assert len(changes) >= 2 and changes[0].key == QUEUE and changes[0].outcome == "kept"
    raised = [c for c in changes if c.key == INFLIGHT]
    assert len(raised) >= 1 and raised[0].outcome == "kept"
    assert all(c.key in knobs.LIVE_KEYS and c.cause for c in changes)
    rows = read_metrics(out)
    assert len(rows) == 40
    columns = [row[f"autopilot/{INFLIGHT}"] for row in rows]
    assert columns[0] == 1 and max(columns) > 1
    assert all(f"autopilot/{key}" in row for row in rows for key in knobs.LIVE_KEYS)
    # A metrics row holds the value the step ran with: the change lands the step after.
    first = raised[0]
    assert columns[first.step - 1] == first.old and columns[first.step] == first.new
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"autopilot: {len(changes)} change(s)" in printed
    assert f"after step {first.step}: {INFLIGHT} 1 -> {first.new} (kept" in printed

