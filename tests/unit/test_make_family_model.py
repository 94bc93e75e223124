"""``async-rl make-model --arch ARCH``: a tiny random model of a Hugging Face family, by
path, that transformers loads and the simulator sizes; an architecture it does not build
exits 2 in one line naming --arch. A family whose engine a weight version cannot reach
(gpt_oss) is refused at start by ``async-rl train`` unless only adapters train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl.cli import main
from async_rl.config_io import load_config
from async_rl.models.families import ARCHITECTURES
from async_rl.run.inputs import check_inputs
from async_rl.sim.costs import model_shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_make_model_arch_writes_a_moe_model_the_simulator_sizes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "moe"
    assert main(["make-model", "--arch", "qwen3_moe", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"model written to {out}: a tiny qwen3_moe, ")
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    model = AutoModelForCausalLM.from_pretrained(out)
    stored = model.num_parameters()
    assert f"{stored:,} parameters" in printed
    assert AutoTokenizer.from_pretrained(out).decode([3 + ord("7")]) == "7"
    shape = model_shape(str(out), "float32")
    assert shape.parameters == stored  # Qwen3's per-head query and key norms too
    assert 0 < shape.active_parameters < 0.8 * shape.parameters  # 2 of 4 experts a token


def test_an_architecture_make_model_does_not_build_exits_2_naming_arch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-model", "--arch", "bert", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--arch bert" in err
    assert all(arch in err for arch in ARCHITECTURES)
    assert main(["make-model", "--arch", "llama", "--size", "tiny",
                 "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--arch llama" in err and "--size" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_family_versions_cannot_reach_is_refused_at_start_unless_lora(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "gpt-oss"
    assert main(["make-model", "--arch", "gpt_oss", "--out", str(model)]) == 0
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\npath = "{model}"\n[run]\noutput_dir = "{tmp_path / "run"}"\n')
    capsys.readouterr()
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.path" in err and "gpt_oss: vLLM" in err
    assert not (tmp_path / "run").exists()
    adapters = load_config(config, ["model.lora.rank=8", "model.lora.target_modules=[\"q_proj\"]"])
    assert check_inputs(adapters).model.path == str(model)  # adapters only: not refused
