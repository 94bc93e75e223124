"""run.layout: the config key, the auto rule and the busy board (no Ray, no model)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from async_rl.config import Config
from async_rl.config_io import load_config
from async_rl.control.auto_layout import AUTO_MARGIN, choose_layout, keep_shared
from buffers.config import ConfigError
from workers.core_share import (
    BusyFlag,
    CoreShare,
    create_board,
)

BASE = '[model]\npath = "runs/tiny-model"\n'


def config_with(tmp_path: Path, *overrides: str) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(BASE)
    return load_config(path, list(overrides))


def test_layout_defaults_to_split_and_accepts_each_choice(tmp_path: Path) -> None:
    assert config_with(tmp_path).run.layout == "split"
    for layout in ("split", "shared", "auto"):
        assert config_with(tmp_path, f"run.layout={layout}").run.layout == layout


def test_layout_rejects_unknown_values_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run.layout = 'mixed': expected one of 'split'"):
        config_with(tmp_path, "run.layout=mixed")


def test_colocate_needs_split(tmp_path: Path) -> None:
    assert config_with(tmp_path, "run.colocate=true").run.colocate
    with pytest.raises(ConfigError, match=r"run.layout = 'shared': must be \"split\""):
        config_with(tmp_path, "run.colocate=true", "run.layout=shared")


def test_auto_shares_when_training_is_the_bottleneck() -> None:
    choice, why = choose_layout(train_s=1.35, generate_s=0.55)  # the CPU default, fp32
    assert choice == "shared"
    assert "training is the bottleneck" in why and "1.35" in why and "0.55" in why


def test_auto_splits_when_generation_is_the_bottleneck() -> None:
    choice, why = choose_layout(train_s=0.3, generate_s=2.9)  # the long-tail task
    assert choice == "split"
    assert "not the bottleneck" in why


def test_auto_splits_when_the_stages_are_balanced() -> None:
    assert choose_layout(1.0, 1.0)[0] == "split"
    assert choose_layout(AUTO_MARGIN * 1.0, 1.0)[0] == "shared"
    assert choose_layout(AUTO_MARGIN * 0.99, 1.0)[0] == "split"


def test_auto_shares_when_generation_cost_nothing() -> None:
    assert choose_layout(0.5, 0.0)[0] == "shared"


def test_auto_keeps_shared_only_if_it_measured_faster() -> None:
    choice, why = keep_shared(split_step_s=0.55, shared_step_s=0.45)
    assert choice == "shared" and "faster" in why
    choice, why = keep_shared(split_step_s=0.55, shared_step_s=2.6)
    assert choice == "split" and "back to split" in why
    assert keep_shared(0.5, 0.5)[0] == "split"  # a tie keeps the simpler layout


def test_busy_flag_writes_the_board_and_counts_busy_time(tmp_path: Path) -> None:
    board = create_board(str(tmp_path), 2, "t")
    assert Path(board).read_bytes() == b"\0\0"
    flag = BusyFlag(board, rank=1)
    flag.set(True)
    flag.set(True)  # no change
    assert Path(board).read_bytes() == b"\0\1"
    assert flag.busy_seconds() >= 0.0
    flag.set(False)
    assert Path(board).read_bytes() == b"\0\0"
    spent = flag.busy_seconds()
    assert spent == flag.busy_seconds()  # not counting while idle


def test_core_share_uses_every_core_only_while_rollout_idles(tmp_path: Path) -> None:
    import torch

    cores = tuple(sorted(os.sched_getaffinity(0)))
    threads = torch.get_num_threads()
    board = create_board(str(tmp_path), 1, "t")
    share = CoreShare(cores[:1], cores[1:], board)
    try:
        assert share.apply() == 1  # not enabled yet: own cores only
        share.enabled = True
        assert share.apply() == len(cores)  # rollout idle
        BusyFlag(board, rank=0).set(True)
        assert share.apply() == 1  # rollout busy: back to its own
        share.enabled = False
        assert share.apply() == 1
        assert os.sched_getaffinity(0) == set(cores[:1])  # narrowed back to its own
        share.idle()
        assert 1.0 <= share.mean_cores() <= len(cores)
    finally:
        os.sched_setaffinity(0, set(cores))
        torch.set_num_threads(threads)
