"""`async-rl compare`'s setup parsing, fixed batch and agreement (no processes started:
tests/integration/test_compare.py runs it on the tiny model)."""

from __future__ import annotations

import pytest

from async_rl.cli import main
from async_rl.compare import (
    Setup,
    SetupFigures,
    agreement,
    base_config,
    fixed_batch,
    setup_configs,
    split_setups,
    summarise_setup,
    within,
)
from async_rl.config import Config
from buffers.common.config import ConfigError
from buffers.common.records import Group
from buffers.common.train_records import LossStats, ShardStepResult
from workers.trainer.compare import ShardFigures

OPTIONS = {"--set", "--model", "--steps", "--json"}


def test_split_setups_takes_every_unknown_flag_with_its_group() -> None:
    rest, setups = split_setups(
        ["cfg.toml", "--a", "trainer.backend=ddp", "--steps", "2",
         "--c=trainer.backend=fsdp2,trainer.offload=true", "--set", "trainer.lr=1e-5",
         "--b", "trainer.backend=fsdp2,trainer.micro_batch_tokens=512"], OPTIONS)
    assert rest == ["cfg.toml", "--steps", "2", "--set", "trainer.lr=1e-5"]
    assert [s.name for s in setups] == ["a", "c", "b"]
    assert setups[1].overrides == ("trainer.backend=fsdp2", "trainer.offload=true")
    assert setups[2].overrides == ("trainer.backend=fsdp2", "trainer.micro_batch_tokens=512")


def test_a_comma_inside_a_value_stays_in_it() -> None:
    _, (setup,) = split_setups(["--a", 'model.dtype="float32",trainer.lr=1e-5'], OPTIONS)
    assert setup.overrides == ('model.dtype="float32"', "trainer.lr=1e-5")
    _, (listed,) = split_setups(["--x", "trainer.lr=1e-5,queue.bucket_edges=[1,2]"], OPTIONS)
    assert listed.overrides == ("trainer.lr=1e-5", "queue.bucket_edges=[1,2]")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--a"], "--a: expected section.key=value"),
    (["--a", "--b", "trainer.backend=ddp"], "--a: expected section.key=value"),
    (["--a", "x=1", "--a", "y=2"], "--a: setup given twice"),
    (["--a.b", "x=1"], "--a.b: a setup's name is a word"),
])
def test_split_setups_refuses_a_flag_without_a_group(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        split_setups(argv, OPTIONS)


def _base() -> Config:
    return base_config(None, ["model.path=/nowhere", "trainer.num_shards=2"])


def test_setup_configs_apply_each_group_over_the_base() -> None:
    a, b = setup_configs(_base(), [Setup(name="a", overrides=("trainer.backend=ddp",)),
                                   Setup(name="b", overrides=("trainer.backend=fsdp2",
                                                              "trainer.offload=true"))])
    assert (a.trainer.backend, a.trainer.num_shards, a.model.path) == ("ddp", 2, "/nowhere")
    assert (b.trainer.backend, b.trainer.offload, b.trainer.num_shards) == ("fsdp2", True, 2)


@pytest.mark.parametrize(("groups", "needle"), [
    ([("trainer.backend=ddp",)], "needs two or more setups .* got 1"),
    ([("trainer.bogus=1",), ("trainer.backend=fsdp2",)], "trainer.bogus = '1': unknown key"),
    ([("trainer.backend",), ("trainer.backend=fsdp2",)], "override 'trainer.backend'"),
    ([("rollout.group_size=4",), ("trainer.backend=fsdp2",)],
     "rollout.group_size: a setup .* may set only trainer and model keys"),
    ([("model.path=/x",), ("trainer.backend=fsdp2",)], "model.path: a setup"),
    ([("trainer.offload=true",), ("trainer.backend=fsdp2",)], "trainer.offload = True"),
])
def test_setup_configs_refuse_bad_groups_in_one_line(groups: list[tuple[str, ...]],
                                                     needle: str) -> None:
    setups = [Setup(name=f"s{i}", overrides=g) for i, g in enumerate(groups)]
    with pytest.raises(ConfigError, match=needle) as err:
        setup_configs(_base(), setups)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--a", "trainer.backend=ddp"], "got 1"),
    (["--a", "trainer.backend=ddp", "--b", "trainer.nope=1"], "trainer.nope"),
    (["--a", "trainer.backend=ddp", "--b"], "--b: expected"),
])
def test_the_cli_exits_2_with_one_line(argv: list[str], needle: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--model", "/nowhere", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_the_fixed_batch_is_the_same_for_the_same_seed() -> None:
    base = base_config(None, ["model.path=/nowhere", "trainer.groups_per_step=4",
                              "rollout.group_size=4"])
    first, again = fixed_batch(base, seed=1), fixed_batch(base, seed=1)
    assert len(first) == 4 and all(g.num_samples == 4 for g in first)
    def tokens(groups: list[Group]) -> list[list[int]]:
        return [g.tokens.completion_token_ids.tolist() for g in groups]

    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(fixed_batch(base, seed=2))


def _shard(rank: int, loss_sums: list[float], norm: float, diff: float | None) -> ShardFigures:
    return ShardFigures(
        rank=rank, step_s=[[1.0, 4.0], [2.0, 3.0]][rank],
        results=[ShardStepResult(rank=rank, step=1, loss=LossStats(tokens=10, loss_sum=v),
                                 grad_norm=norm, forward_s=0, backward_s=0, optimizer_s=0,
                                 barrier_s=0) for v in loss_sums],
        rss_setup_mb=100.0, peak_rss_mb=200.0 + rank, parameters=5, max_param_diff=diff)


def test_summarise_setup_adds_shards_and_compares_with_the_first() -> None:
    first = summarise_setup(Setup(name="a", overrides=()),
                            [_shard(0, [1.0, 2.0, 3.0], 0.5, None),
                             _shard(1, [3.0, 2.0, 1.0], 0.5, None)], None, 1e-4)
    assert first.losses == [0.2, 0.2, 0.2]
    assert first.step_s == pytest.approx(3.0)  # the median of the slowest shard's
    assert (first.peak_rss_mb, first.peak_rss_mb_per_shard) == (201.0, [200.0, 201.0])
    assert first.agree
    same = summarise_setup(Setup(name="b", overrides=()),
                           [_shard(0, [1.0, 2.0, 3.0], 0.5, 1e-6),
                            _shard(1, [3.0, 2.0, 1.0], 0.5, None)], first, 1e-4)
    assert same.agree and same.max_param_diff == 1e-6
    moved = summarise_setup(Setup(name="c", overrides=()),
                            [_shard(0, [1.0, 2.0, 3.1], 0.5, 1e-6),
                             _shard(1, [3.0, 2.0, 1.0], 0.5, None)], first, 1e-4)
    assert not moved.agree


def _figures(losses: list[float], norms: list[float], diff: float) -> SetupFigures:
    return SetupFigures(name="x", overrides=(), step_s=1.0, peak_rss_mb=1.0,
                        peak_rss_mb_per_shard=[1.0], rss_setup_mb=[1.0], losses=losses,
                        grad_norms=norms, max_param_diff=diff, agree=True)


def test_agreement_is_relative_above_one_and_absolute_below() -> None:
    assert within(1000.0, 1000.05, 1e-4) and not within(1000.0, 1000.2, 1e-4)
    assert within(1e-9, 5e-5, 1e-4) and not within(0.0, 2e-4, 1e-4)
    first = _figures([0.5, 0.4], [2.0, 1.5], 0.0)
    assert agreement(_figures([0.50001, 0.4], [2.0001, 1.5], 5e-5), first, 1e-4)
    assert not agreement(_figures([0.5, 0.4], [2.0, 1.5], 2e-4), first, 1e-4)
    assert not agreement(_figures([0.5, 0.41], [2.0, 1.5], 0.0), first, 1e-4)
    assert not agreement(_figures([0.5, 0.4], [2.0, 1.6], 0.0), first, 1e-4)
