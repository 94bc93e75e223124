"""async-rl tune: the search on the simulator, its guards and edge cases, tuned.toml, the
command's bad input (the real runs' path is tested where they are run)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from rich.console import Console

from async_rl import knobs
from async_rl.cli import main
from async_rl.config import Config
from async_rl.config_io import load_config
from async_rl.knobs import Range
from async_rl.tuning import tune as tune_module
from async_rl.tuning.real_runs import Calibration, Measurement
from async_rl.tuning.search import Candidate, Evaluator, SearchResult, search, searchable
from async_rl.tuning.simulated import Evaluation, simulated
from async_rl.tuning.tuned_file import tuned_text

TINY = """\
# A tiny simulated job: two rollout engines, one prompt in flight each.
[model]
path = "not-needed"

[task]
kind = "longtail"
eval_size = 0

[rollout]
num_workers = 2
group_size = 4
max_new_tokens = 128
max_inflight_prompts = 1  # the user's own comment

[queue]
max_groups = 32
bucket_edges = [128, 512]

[trainer]
num_shards = 1
groups_per_step = 8
micro_batch_tokens = 512

[run]
num_steps = 8
progress = false
output_dir = "{out}"

[simulate]
parameters = 4.0e6
kv_bytes_per_token = 4096
lengths = "lognormal"
length_median = 30.0
length_sigma = 0.8
"""


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY.format(out=tmp_path / "run"))
    return path


def fake(peak: int) -> tuple[list[Config], Evaluator]:
    """An evaluator whose groups/s peaks at ``peak`` prompts in flight and rises with
    staleness and the step's groups; the trainer waits for data below the peak."""
    seen: list[Config] = []

    def evaluate(config: Config) -> Evaluation:
        seen.append(config)
        inflight = config.rollout.max_inflight_prompts
        gain = ((1 + config.staleness.max_staleness) * config.trainer.groups_per_step
                / (1.0 + abs(math.log2(inflight / peak))))
        waits = 0.5 if inflight < peak else 0.01
        return Evaluation(groups_per_s=gain, steps=8,
                          idle={"trainer": {"wait_data": waits}, "rollout": {}})
    return seen, evaluate


def test_search_finds_a_known_better_point_on_a_tiny_simulated_config(tiny: Path) -> None:
    config = load_config(tiny)
    ranges: dict[str, Range] = {"rollout.max_inflight_prompts": (1, 16)}
    result = search(config, ranges, simulated)
    assert result.ranked, "one prompt in flight per engine starves the trainer"
    best = result.ranked[0]
    assert best.values["rollout.max_inflight_prompts"] >= 4
    assert best.groups_per_s > 1.3 * result.base.groups_per_s
    assert "trainer waits for data" in best.reasons["rollout.max_inflight_prompts"]
    again = search(config, ranges, simulated)  # deterministic given the config's seeds
    assert [c.values for c in again.ranked] == [c.values for c in result.ranked]
    assert [c.groups_per_s for c in again.ranked] == [c.groups_per_s for c in result.ranked]


def test_the_search_walks_to_the_peak_the_idle_cause_points_at(tiny: Path) -> None:
    config = load_config(tiny)
    seen, evaluate = fake(peak=16)
    result = search(config, {"rollout.max_inflight_prompts": (1, 64)}, evaluate)
    assert result.ranked[0].values == {"rollout.max_inflight_prompts": 16}
    assert result.evaluated == len(seen) <= 7  # the ladder 1..64 has 7 rungs
    assert result.stopped == "converged"


def test_default_ranges_never_change_guarded_keys_nor_staleness_above_the_ceiling(
        tiny: Path) -> None:
    config = load_config(tiny, ["staleness.max_staleness=1"])
    seen, evaluate = fake(peak=4)  # rewards more staleness and bigger steps
    result = search(config, knobs.allowed_ranges([], config), evaluate)
    assert len(seen) > 5 and result.ranked
    guarded = {k.key for k in knobs.KNOBS if k.guarded}
    for candidate in result.ranked:
        assert not guarded & set(candidate.values)
    assert max(c.staleness.max_staleness for c in seen) == 1
    assert {c.trainer.groups_per_step for c in seen} == {8}
    lifted = search(config, knobs.allowed_ranges(["staleness.max_staleness=1..3"], config),
                    evaluate)
    assert lifted.ranked[0].values["staleness.max_staleness"] == 3


def test_a_budget_of_evaluations_stops_the_search(tiny: Path) -> None:
    config = load_config(tiny)
    seen, evaluate = fake(peak=64)
    result = search(config, knobs.allowed_ranges([], config), evaluate, max_evaluations=3)
    assert len(seen) == result.evaluated == 3
    assert result.stopped == "evaluations"


def test_degenerate_ranges(tiny: Path) -> None:
    config = load_config(tiny)
    _, evaluate = fake(peak=8)
    assert searchable(config, {}) == []
    empty = search(config, {}, evaluate)
    assert empty.ranked == () and empty.evaluated == 1
    # One value, not the config's: the start moves there, and nothing else is tried.
    single = search(config, {"rollout.max_inflight_prompts": (8, 8)}, evaluate)
    assert searchable(config, {"rollout.max_inflight_prompts": (8, 8)}) == [
        "rollout.max_inflight_prompts"]
    assert [c.values for c in single.ranked] == [{"rollout.max_inflight_prompts": 8}]
    # Every candidate refused by the config's rules (a step must fit the queue).
    refused = search(config, {"queue.max_groups": (1, 4)}, evaluate)
    assert refused.ranked == () and refused.failed == 3 and refused.evaluated == 1


def test_nothing_to_tune_writes_the_config_unchanged_and_says_so(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tune_module.knobs, "allowed_ranges", lambda items, config: {})
    out = tmp_path / "tuned.toml"
    assert main(["tune", str(tiny), "--simulate-only", "--out", str(out)]) == 0
    assert "nothing to tune" in capsys.readouterr().out
    assert out.read_text() == tiny.read_text()


def test_tuned_file_sets_each_key_in_its_section_and_loads_back(tiny: Path) -> None:
    config = load_config(tiny)
    cluster = load_config(tiny, ['simulate.hardware="h100"'])
    values = {"rollout.max_inflight_prompts": 8,  # in the file, with a comment of its own
              "trainer.micro_batch_tokens": 1024,  # in the file
              "queue.max_groups": 64,  # in the file, last of its section
              "weights.sync_every": 1,  # no [weights] section
              "staleness.max_staleness": 0}  # no [staleness] section
    tuned = knobs.with_values(config, values)
    text = tuned_text(tiny.read_text(), values, {key: f"tuned: why {key}" for key in values})
    path = tiny.with_name("tuned.toml")
    path.write_text(text)
    assert load_config(path) == tuned
    lines = text.splitlines()
    for key in values:
        name = key.split(".")[1]
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{name} ="))
        assert lines[at - 1] == f"# tuned: why {key}"
    assert text.count("[rollout]") == 1 and "# A tiny simulated job" in text
    split = knobs.with_values(cluster, {"split": 1})
    assert (split.rollout.num_workers, split.trainer.num_shards) == (1, 2)


def test_tune_simulate_only_writes_the_tuned_config_and_a_table(
        tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tuned.toml"
    assert main(["tune", str(tiny), "--simulate-only", "--out", str(out), "--budget-s", "60",
                 "--allow", "rollout.max_inflight_prompts=1..16",
                 "--set", "run.num_steps=6"]) == 0
    printed = capsys.readouterr().out
    assert "predicted groups/s" in printed and "tuned config written" in printed
    tuned = load_config(out)
    assert tuned.rollout.max_inflight_prompts > 1 and tuned.run.num_steps == 6
    assert "# tuned: trainer waits for data" in out.read_text()


@pytest.mark.parametrize(("allow", "names"), [
    ("model.path", "--allow model.path: not a tunable key"),
    ("rollout.max_inflight_prompts=0..8", "rollout.max_inflight_prompts may only be"),
    ("staleness.max_staleness=0..99", "staleness.max_staleness may only be"),
])
def test_tune_bad_allow_exits_2_naming_the_key(
        tiny: Path, tmp_path: Path, allow: str, names: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", str(tiny), "--simulate-only", "--allow", allow,
                 "--out", str(tmp_path / "tuned.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert names in err and "\n" not in err
    assert not (tmp_path / "tuned.toml").exists()


def test_the_real_path_keeps_the_fastest_measured_candidate_and_says_its_gain(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Calibration and checks stand in for the real runs (tested with them)."""
    hardware = Path(tune_module.__file__).parents[1] / "sim" / "hardware" / "cpu.toml"
    checked: list[dict[str, object]] = []

    def calibration_run(path: str, sets: object, folder: Path, steps: int) -> Calibration:
        run = Measurement(run_dir=folder / "calibration", groups_per_s=1.0, seconds=0.0)
        return Calibration(run=run, hardware=hardware, description="fitted")

    def check_runs(path: str, sets: object, folder: Path, steps: int,
                   candidates: list[dict[str, object]]) -> list[Measurement]:
        checked.extend(candidates)
        return [Measurement(run_dir=folder / f"check-{n}", groups_per_s=1.0 + n, seconds=0.0)
                for n in range(1, len(candidates) + 1)]

    monkeypatch.setattr(tune_module, "calibration_run", calibration_run)
    monkeypatch.setattr(tune_module, "check_runs", check_runs)
    out = tmp_path / "tuned.toml"
    tuned = tune_module.tune(str(tiny), out=str(out), budget_s=60,
                             allow=["rollout.max_inflight_prompts=1..16"],
                             console=Console(width=200))
    assert len(checked) == len(tuned.measured) - 1 >= 1  # the config's own run besides
    assert tuned.result is not None and tuned.chosen == tuned.result.ranked[len(checked) - 1]
    assert f"measured {1.0 + len(checked):.2f}x" in out.read_text()
    assert "measured groups/s" in capsys.readouterr().out


def test_a_slow_calibration_run_leaves_the_search_a_quarter_of_the_budget(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A calibration run that took 40% of the budget would leave the search nothing
    after the two checks' reserve (2 x 40%): it gets 25% instead."""
    hardware = Path(tune_module.__file__).parents[1] / "sim" / "hardware" / "cpu.toml"
    now = [0.0]
    given: list[float] = []

    def calibration_run(path: str, sets: object, folder: Path, steps: int) -> Calibration:
        now[0] += 40.0
        run = Measurement(run_dir=folder / "calibration", groups_per_s=1.0, seconds=40.0)
        return Calibration(run=run, hardware=hardware, description="fitted")

    def search_spy(config: object, ranges: object, evaluate: object, *,
                   budget_s: float) -> None:
        given.append(budget_s)
        raise Stop

    monkeypatch.setattr(tune_module, "calibration_run", calibration_run)
    monkeypatch.setattr(tune_module, "search", search_spy)
    with pytest.raises(Stop):
        tune_module.tune(str(tiny), out=str(tmp_path / "tuned.toml"), budget_s=100,
                         allow=["rollout.max_inflight_prompts=1..16"],
                         console=Console(width=200), clock=lambda: now[0])
    assert given == [25.0]


class Stop(Exception):
    """The search's stand-in ends the tune once it has seen its budget."""


def test_changes_that_buy_nothing_are_left_out_of_the_ranking(tiny: Path) -> None:
    config = load_config(tiny)
    _, evaluate = fake(peak=16)  # queue.max_groups changes nothing
    result = search(config, {"rollout.max_inflight_prompts": (1, 64),
                             "queue.max_groups": (8, 128)}, evaluate)
    assert len(result.ranked) >= 1 and result.evaluated > 7
    assert all("queue.max_groups" not in c.values for c in result.ranked)


def test_a_split_is_written_as_the_counts_it_sets_each_with_its_cause(tiny: Path) -> None:
    config = load_config(tiny, ['simulate.hardware="h100"', "trainer.num_shards=2"])
    evaluation = Evaluation(groups_per_s=2.0, steps=8, idle={})
    base = Candidate(values={}, groups_per_s=1.0, reasons={}, evaluation=evaluation)
    chosen = Candidate(values={"split": 3}, groups_per_s=2.0, evaluation=evaluation,
                       reasons={"split": "trainer waits for data 50% of its time"})
    result = SearchResult(base=base, ranked=(chosen,), evaluated=2, failed=0, seconds=1.0,
                          stopped="converged")
    tuned = knobs.with_values(config, chosen.values)
    notes = tune_module.comments(config, result, chosen, 3.0, 2.0, tuned)
    assert notes == {
        "rollout.num_workers": "tuned: trainer waits for data 50% of its time; 2 -> 3: "
                               "predicted 2.00x (1.00 -> 2.00 groups/s over 8 simulated "
                               "steps), measured 1.50x",
        "trainer.num_shards": "tuned: trainer waits for data 50% of its time; 2 -> 1: "
                              "predicted 2.00x (1.00 -> 2.00 groups/s over 8 simulated "
                              "steps), measured 1.50x"}
