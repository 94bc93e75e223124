"""[reference], [critic], [algorithm] and trainer.kl_*: bounds, the rules tying them to
the trainer, and role models of another architecture or tokenizer refused before
anything starts (exit 2, one line naming the key)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from async_rl.cli import main
from async_rl.config_io import load_config
from buffers.common.config import ConfigError

BASE = '[model]\npath = "runs/tiny-model"\n'

BAD = [
    (["trainer.kl_coef=-0.1"], "trainer.kl_coef", ">= 0"),
    (["trainer.kl_estimator=k4"], "trainer.kl_estimator", "k1"),
    (["trainer.kl_in_reward=true"], "trainer.kl_in_reward", 'algorithm.advantage = "gae"'),
    (["algorithm.advantage=gae", "critic.placement=own", "trainer.kl_coef=0.1",
      "trainer.kl_in_reward=true"], "reference.placement", 'needs "own"'),
    (["algorithm.advantage=gae", "critic.placement=own", "critic.num_shards=2",
      "trainer.num_shards=3"], "critic.num_shards", "must divide trainer.num_shards"),
    (["algorithm.advantage=gae", "critic.placement=own", "trainer.backend=fsdp2"],
     "trainer.backend", '"ddp" only'),
    (["algorithm.advantage=ppo"], "algorithm.advantage", "grpo"),
    (["algorithm.advantage=gae", "critic.num_shards=2"], "critic.num_shards",
     "must equal trainer.num_shards"),
    (["trainer.kl_coef=0.1", "trainer.packed=false"], "trainer.packed", "packed"),
    (["critic.gamma=1.5"], "critic.gamma", "<= 1"),
    (["critic.lam=-0.1"], "critic.lam", ">= 0"),
    (["critic.lr=0"], "critic.lr", "> 0"),
    (["critic.value_clip=-1"], "critic.value_clip", ">= 0"),
    (["critic.warmup_steps=-1"], "critic.warmup_steps", ">= 0"),
]


OWN = [
    ["trainer.kl_coef=0.1", "reference.placement=own"],
    ["algorithm.advantage=gae", "critic.placement=own"],
    ["algorithm.advantage=gae", "critic.placement=own", "critic.num_shards=2",
     "trainer.num_shards=4", "trainer.kl_coef=0.1", "trainer.kl_in_reward=true",
     "reference.placement=own"],
    ["algorithm.advantage=gae", "trainer.kl_coef=0.1", "trainer.kl_in_reward=true",
     "reference.placement=own"],
]


@pytest.mark.parametrize("overrides", OWN)
def test_roles_on_workers_of_their_own_are_accepted(tmp_path: Path,
                                                    overrides: list[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text(BASE)
    config = load_config(path, overrides)
    assert "own" in (config.reference.placement, config.critic.placement)


@pytest.mark.parametrize(("overrides", "key", "allowed"), BAD)
def test_bad_role_keys_are_one_line_naming_the_key(
        tmp_path: Path, overrides: list[str], key: str, allowed: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(BASE)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message and message.startswith("config error: ")
    assert key in message and allowed in message


def test_role_defaults_build_nothing(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(BASE)
    config = load_config(path)
    assert (config.trainer.kl_coef, config.trainer.kl_estimator,
            config.trainer.kl_in_reward) == (0.0, "k3", False)
    assert (config.reference.path, config.reference.placement) == ("", "trainer")
    assert config.algorithm.advantage == "grpo"
    critic = config.critic
    assert (critic.path, critic.num_shards, critic.placement, critic.lr, critic.value_clip,
            critic.gamma, critic.lam, critic.warmup_steps) == (
        "", 1, "trainer", 1e-5, 0.2, 1.0, 1.0, 0)
    assert not config.has_reference and not config.has_critic
    measured = load_config(path, ["reference.path=runs/tiny-model"])
    assert measured.has_reference  # kl_coef = 0 with a reference: KL measured only
    ppo = load_config(path, ["algorithm.advantage=gae", "trainer.kl_coef=0.05",
                             "trainer.kl_in_reward=true"])
    assert ppo.has_reference and ppo.has_critic
    sharded = load_config(path, ["algorithm.advantage=gae", "trainer.backend=fsdp2",
                                 "trainer.num_shards=2", "critic.num_shards=2",
                                 "trainer.groups_per_step=2"])
    assert sharded.has_critic and sharded.trainer.backend == "fsdp2"  # FSDP2 shards it


def _role_model(tmp_path: Path, source: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(source, copy)
    return copy


def _train(tmp_path: Path, model: Path, extra: str,
           capsys: pytest.CaptureFixture[str]) -> str:
    path = tmp_path / "config.toml"
    path.write_text(f'[model]\npath = "{model}"\n{extra}\n[run]\n'
                    f'output_dir = "{tmp_path}/run"\n')
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    return err


def test_a_critic_of_another_architecture_exits_2_naming_the_key(
        tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = _role_model(tmp_path, tiny_model_dir, "llama")
    hf_config = json.loads((other / "config.json").read_text())
    hf_config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (other / "config.json").write_text(json.dumps(hf_config))
    err = _train(tmp_path, tiny_model_dir,
                 f'[algorithm]\nadvantage = "gae"\n[critic]\npath = "{other}"', capsys)
    assert "critic.path" in err and "LlamaForCausalLM" in err


def test_a_reference_with_another_tokenizer_exits_2_naming_the_key(
        tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = _role_model(tmp_path, tiny_model_dir, "renamed")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert len(vocab) > 10
    token = next(t for t in vocab if t not in ("<pad>", "</s>", "<unk>"))
    vocab["renamed-token"] = vocab.pop(token)
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    err = _train(tmp_path, tiny_model_dir,
                 f'[trainer]\nkl_coef = 0.1\n[reference]\npath = "{other}"', capsys)
    assert "reference.path" in err and "tokenizer" in err


def test_a_missing_critic_model_exits_2(
        tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _train(tmp_path, tiny_model_dir,
                 f'[algorithm]\nadvantage = "gae"\n[critic]\npath = "{tmp_path}/none"', capsys)
    assert "critic.path" in err and "config.json" in err
