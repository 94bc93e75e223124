"""The Python API without a run: load_config's overrides, the forms a reward callable may
take, its checks before anything starts, how it travels to another process, and that
``import async_rl`` stays light."""

from __future__ import annotations

import functools
import importlib
import json
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import async_rl
from async_rl.api import as_rewards
from async_rl.run.inputs import check_inputs
from workers.rewards.callables import Reward, check_function, dumps

REPO = Path(__file__).resolve().parents[2]
CONFIG = """
[model]
path = "runs/tiny-model"

[run]
num_steps = 20
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(CONFIG)
    return path


def correctness(prompts: list[str], completions: list[str], answer: list[str],
                **kwargs: Any) -> list[float]:
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


async def short(prompt: str, completion: str) -> float:
    return float(len(completion) < 10)


def test_load_config_takes_python_values_by_section_and_key(config_file: Path) -> None:
    config = async_rl.load_config(config_file, overrides={
        "run.num_steps": 3, "model.path": "Qwen/Qwen2.5-0.5B-Instruct",
        "queue.bucket_edges": [8, 16], "run.progress": False})
    assert isinstance(config, async_rl.Config)
    assert config.run.num_steps == 3
    assert config.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert config.queue.bucket_edges == (8, 16)
    assert config.run.progress is False


def test_load_config_takes_set_items_as_the_cli_does(config_file: Path) -> None:
    config = async_rl.load_config(config_file, overrides=["run.num_steps=4"])
    assert config.run.num_steps == 4


@pytest.mark.parametrize(("overrides", "line"), [
    ({"run.num_stepz": 3}, "config error: run.num_stepz = 3: unknown key"),
    ({"runn.num_steps": 3}, "config error: runn.num_steps = 3: unknown section 'runn'"),
    ({"run.num_steps": "three"}, "config error: run.num_steps = 'three': expected `int`"),
    ({"run.num_steps": 0}, "config error: run.num_steps = 0: expected `int` >= 1"),
    ({"num_steps": 3}, "config error: override 'num_steps': expected 'section.key'"),
])
def test_a_bad_override_is_one_line_naming_the_key(config_file: Path, overrides: dict[str, Any],
                                                   line: str) -> None:
    with pytest.raises(async_rl.ConfigError) as err:
        async_rl.load_config(config_file, overrides=overrides)
    assert str(err.value).startswith(line)
    assert "\n" not in str(err.value)


def test_rewards_are_callables_pairs_or_reward_records() -> None:
    named = Reward(fn=short, weight=0.5, name="brief", style="sample")
    rewards = as_rewards([correctness, (short, 2), named])
    assert rewards == (Reward(fn=correctness), Reward(fn=short, weight=2.0), named)
    assert as_rewards(correctness) == (Reward(fn=correctness),)


@pytest.mark.parametrize(("rewards", "line"), [
    ([correctness, "my_rewards.py:score"], "config error: rewards[1] = 'my_rewards.py:score':"),
    ([(correctness, "heavy")], "config error: rewards[0] = "),
    (3, "config error: rewards = 3: expected a list"),
])
def test_anything_else_is_one_line_naming_its_place(rewards: Any, line: str) -> None:
    with pytest.raises(async_rl.ConfigError) as err:
        as_rewards(rewards)
    assert str(err.value).startswith(line)


def no_parameters() -> float:
    return 1.0


def needs_a_column(prompt: str, completion: str, difficulty: str) -> float:
    return 1.0


@pytest.mark.parametrize(("reward", "why"), [
    (Reward(fn=no_parameters), "rewards[0] (no_parameters): takes no parameters"),
    (Reward(fn=needs_a_column), "rewards[0] (needs_a_column): required parameter(s) "
                                "'difficulty' are given by no sample-style argument"),
    (Reward(fn=correctness, weight=float("nan")), "(correctness): weight = nan: must be"),
    (Reward(fn=correctness, style="grpo"), "(correctness): style = 'grpo': expected one of"),
    (Reward(fn=42), "rewards[0] = 42: not callable"),
])
def test_a_reward_that_cannot_score_is_refused_before_the_run(reward: Reward, why: str) -> None:
    with pytest.raises(async_rl.ConfigError) as err:
        check_function(reward)
    assert why in str(err.value)
    assert str(err.value).startswith("config error: rewards[0]")


def test_a_reward_that_cannot_travel_is_refused(tmp_path: Path) -> None:
    lock = threading.Lock()

    def locked(prompt: str, completion: str) -> float:
        with lock:
            return 1.0

    with pytest.raises(async_rl.ConfigError, match=r"rewards\[0\] \(locked\): cannot be sent "
                                                   r"to the workers \(TypeError"):
        check_function(Reward(fn=locked))


def test_check_inputs_checks_the_callables_after_the_config(tmp_path: Path,
                                                            config_file: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    config = async_rl.load_config(config_file, overrides={"model.path": str(model)})
    assert check_inputs(config, (Reward(fn=correctness),)).model.path == str(model)
    with pytest.raises(async_rl.ConfigError, match=r"rewards\[1\] \(no_parameters\)"):
        check_inputs(config, (Reward(fn=correctness), Reward(fn=no_parameters)))


def test_a_reward_from_a_module_no_worker_imports_travels_by_value(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "scripted_rewards.py").write_text(
        "BONUS = 0.5\n"
        "def lucky(prompt, completion):\n"
        "    return BONUS + len(completion)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("scripted_rewards")
    sent = pickle.dumps(Reward(fn=functools.partial(module.lucky), weight=2.0, name="luck"))
    monkeypatch.delitem(sys.modules, "scripted_rewards")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("scripted_rewards")
    received = pickle.loads(sent)
    assert received.weight == 2.0 and received.name == "luck"
    assert received.fn("p", "abc") == 3.5


def test_an_installed_library_function_travels_by_reference() -> None:
    assert pickle.loads(dumps(json.dumps)) is json.dumps


def test_import_async_rl_loads_no_ray_torch_or_vllm() -> None:
    script = ("import sys, async_rl\n"
              "async_rl.load_config, async_rl.train, async_rl.Reward, async_rl.RunSummary\n"
              "print(sorted(m for m in ('ray', 'torch', 'vllm', 'transformers')"
              " if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        async_rl.trian  # noqa: B018
