"""staleness.max_ahead: how far generation may run ahead (the admission gate), apart from
staleness.max_staleness, the bound past which the queue drops a group; -1 keeps the one
knob of before. The gate alone, the config's rules, and the gate with the queue."""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.abc
import msgspec
import pytest
from async_helpers import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from test_staleness import Item, admitted_now

from async_rl.cli import main
from async_rl.config import Config
from async_rl.config_io import load_config
from async_rl.knobs import bounds, ceiling_bounds
from buffers import AdmissionGate, Dropped, ReplayQueue
from buffers.common.config import ConfigError, StalenessConfig


def limits(gate: AdmissionGate, versions: int) -> list[int]:
    """The gate's limit at versions 0 .. versions - 1, admitting all it allows at each."""
    seen = []
    for version in range(versions):
        gate.on_version(version)
        admitted_now(gate)
        seen.append(gate.limit)
    return seen


# ---- the gate alone -----------------------------------------------------------------


def test_max_ahead_below_max_staleness_admits_only_that_far_ahead() -> None:
    gate = AdmissionGate(groups_per_step=3, max_staleness=3, max_ahead=1)
    assert gate.ahead == 1
    assert admitted_now(gate) == (0 + 1 + 1) * 3 == gate.started
    gate.on_version(2)
    assert gate.limit == (2 + 1 + 1) * 3 and admitted_now(gate) == 6
    assert gate.statistics().limit == 12


def test_max_ahead_equal_to_max_staleness_and_none_are_todays_gate() -> None:
    for staleness in range(4):
        today = AdmissionGate(groups_per_step=2, max_staleness=staleness)
        same = AdmissionGate(groups_per_step=2, max_staleness=staleness, max_ahead=staleness)
        assert today.ahead == same.ahead == staleness
        assert limits(today, 5) == limits(same, 5) == [(v + staleness + 1) * 2
                                                       for v in range(5)]


def test_the_default_config_builds_todays_gate() -> None:
    section = StalenessConfig()
    assert section.max_ahead == -1 and section.admission_ahead == section.max_staleness == 2
    gate = AdmissionGate.from_config(section, groups_per_step=4)
    assert gate.max_ahead is None and gate.ahead == 2 and gate.limit == 12
    set_ahead = AdmissionGate.from_config(StalenessConfig(max_staleness=2, max_ahead=0),
                                          groups_per_step=4)
    assert set_ahead.max_ahead == 0 and set_ahead.limit == 4


def test_max_ahead_0_is_synchronous_whatever_max_staleness() -> None:
    gate = AdmissionGate(groups_per_step=4, max_staleness=5, max_ahead=0)
    assert admitted_now(gate) == 4
    for version in range(1, 5):
        assert admitted_now(gate) == 0  # nothing more until the next version
        gate.on_version(version)
        assert admitted_now(gate) == 4
    assert gate.started == 20 == gate.limit


def test_a_retuned_max_staleness_caps_max_ahead_and_a_raised_one_does_not_pass_it() -> None:
    gate = AdmissionGate(groups_per_step=2, max_staleness=3, max_ahead=2)
    assert admitted_now(gate) == 6
    gate.set_max_staleness(1)  # the autopilot lowers the drop bound below max_ahead
    assert gate.ahead == 1 and gate.limit == 4 and admitted_now(gate) == 0
    gate.on_version(2)
    assert admitted_now(gate) == 2  # (2 + 1 + 1) * 2 = 8 slots, 6 held
    gate.set_max_staleness(4)  # raised past max_ahead: admission stops at max_ahead
    assert gate.ahead == 2 and gate.limit == 10 and admitted_now(gate) == 2


@pytest.mark.asyncio
async def test_waiters_get_only_the_slots_max_ahead_opens() -> None:
    gate = AdmissionGate(groups_per_step=1, max_staleness=2, max_ahead=0)
    assert gate.try_acquire() and not gate.try_acquire()
    got: list[int] = []

    async def rollout(i: int) -> None:
        await gate.acquire()
        got.append(i)

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(rollout, i)
                await wait_until(lambda i=i: gate.statistics().waiting_now == i + 1)
            gate.on_version(1)  # one step's slot, not max_staleness' worth
            await wait_until(lambda: len(got) == 1)
            assert gate.statistics().waiting_now == 1 and not gate.try_acquire()
            gate.on_version(2)
    assert got == [0, 1]


def test_a_negative_max_ahead_is_refused_by_the_gate() -> None:
    with pytest.raises(ValueError, match="max_ahead"):
        AdmissionGate(groups_per_step=1, max_staleness=1, max_ahead=-1)


# ---- the config's rules -------------------------------------------------------------

GOOD = '[model]\npath = "m"\n'


def write(tmp_path: Path, text: str = GOOD) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("overrides", "allowed"), [
    (["staleness.max_ahead=3"], "must be <= staleness.max_staleness (2)"),
    (["staleness.max_ahead=-2"], ">= -1"),
    (["staleness.max_staleness=0", "staleness.max_ahead=1"],
     "must be <= staleness.max_staleness (0)"),
    (["weights.sync_every=3", "staleness.max_ahead=1"],
     "must be >= weights.sync_every - 1 (2)"),
])
def test_a_bad_max_ahead_is_one_line_naming_the_key(
        tmp_path: Path, overrides: list[str], allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path), overrides)
    message = str(info.value)
    assert "\n" not in message and message.startswith("config error: staleness.max_ahead = ")
    assert allowed in message


def test_the_cli_exits_2_with_one_line_naming_max_ahead(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", str(write(tmp_path)), "--set", "staleness.max_ahead=5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "staleness.max_ahead = 5" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("ahead", [-1, 0, 1, 2])
def test_max_ahead_from_minus_1_to_max_staleness_is_accepted(tmp_path: Path, ahead: int) -> None:
    config = load_config(write(tmp_path), [f"staleness.max_ahead={ahead}"])
    assert config.staleness.max_ahead == ahead
    assert config.staleness.admission_ahead == (2 if ahead < 0 else ahead)
    if ahead != 0:  # weights.sync_every k needs k - 1 versions ahead
        synced = load_config(write(tmp_path), [f"staleness.max_ahead={ahead}",
                                               "weights.sync_every=2"])
        assert synced.staleness.admission_ahead >= synced.weights.sync_every - 1 == 1


def test_a_search_keeps_max_staleness_at_or_above_a_set_max_ahead(tmp_path: Path) -> None:
    today = load_config(write(tmp_path))
    assert bounds("staleness.max_staleness", today) == (0, 2)
    assert bounds("weights.sync_every", today) == (1, 3)
    config = msgspec.structs.replace(
        today, staleness=StalenessConfig(max_staleness=3, max_ahead=1))
    assert isinstance(config, Config)
    assert bounds("staleness.max_staleness", config) == (1, 3)
    assert ceiling_bounds("staleness.max_staleness", config) == (1, 64)
    # sync_every k needs the gate to admit k - 1 versions ahead.
    assert bounds("weights.sync_every", config) == (1, 2)


# ---- the gate with the queue --------------------------------------------------------


def run_pipeline(lengths: list[int], *, groups_per_step: int, max_staleness: int,
                 max_ahead: int | None, steps: int, wait_for_expiring: bool,
                 ) -> tuple[list[tuple[int, int]], list[Dropped[Item]]]:
    """Rollout as the orchestrator runs it, prompts without end: a prompt starts once the
    gate admits it, its group takes ``lengths[i % len]`` loop turns to generate (groups
    finish out of order), a group the queue drops gives its slot back (a trained one
    keeps it: the limit grows by a step's groups a version). Returns each
    trained group's (version trained at, min_version) and the drops; checks the gate's
    bound at every admission."""
    gate = AdmissionGate(groups_per_step=groups_per_step, max_staleness=max_staleness,
                         max_ahead=max_ahead)
    ahead = max_staleness if max_ahead is None else min(max_ahead, max_staleness)
    dropped: list[Dropped[Item]] = []

    def on_drop(drop: Dropped[Item]) -> None:
        dropped.append(drop)
        gate.release()

    queue = ReplayQueue[Item](max_groups=64, max_tokens=10_000, max_staleness=max_staleness,
                              on_drop=on_drop, wait_for_expiring=wait_for_expiring)
    trained: list[tuple[int, int]] = []

    async def generate(i: int) -> None:
        version = gate.version
        with queue.expecting(version):
            for _ in range(lengths[i % len(lengths)]):
                await anyio.sleep(0)
        await queue.put(Item(prompt_id=f"p{i}", min_version=version))

    async def rollout(generations: anyio.abc.TaskGroup) -> None:
        i = 0
        while True:
            await gate.acquire()
            # The slot just taken is the started-th: its step is (started - 1) // gps.
            assert (gate.started - 1) // groups_per_step - gate.version <= ahead
            generations.start_soon(generate, i)
            i += 1

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(rollout, tg)
                for version in range(steps):
                    got = await queue.take(groups_per_step, at_version=version)
                    trained.extend((version, x.min_version) for x in got)
                    gate.on_version(version + 1)
                tg.cancel_scope.cancel()

    anyio.run(main)
    return trained, dropped


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=12),
    groups_per_step=st.integers(1, 3),
    max_staleness=st.integers(0, 3),
    ahead_below=st.integers(0, 3),
    wait_for_expiring=st.booleans(),
)
def test_no_trained_group_passes_max_staleness_and_none_starts_past_max_ahead(
        lengths: list[int], groups_per_step: int, max_staleness: int, ahead_below: int,
        wait_for_expiring: bool) -> None:
    max_ahead = max(0, max_staleness - ahead_below)
    steps = 6
    trained, dropped = run_pipeline(lengths, groups_per_step=groups_per_step,
                                    max_staleness=max_staleness, max_ahead=max_ahead,
                                    steps=steps, wait_for_expiring=wait_for_expiring)
    assert len(trained) == steps * groups_per_step
    assert all(0 <= version - made <= max_staleness for version, made in trained)
    assert all(drop.at_version - drop.min_version > max_staleness for drop in dropped)
    if max_ahead == 0:  # every group is generated and trained under one version
        assert not dropped and all(version == made for version, made in trained)
    if wait_for_expiring:
        assert not dropped
