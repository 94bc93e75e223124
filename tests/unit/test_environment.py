"""The environment protocol and its config: EnvStep, [task.environment], loading the class."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

import async_rl
from async_rl.config_io import decode_config, load_config, to_toml
from buffers.common.config import ConfigError
from workers.rollout.environment import EnvironmentConfig, environment_class

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ADDER = f"{FIXTURES / 'adder_env.py'}:AdderEnv"


def write_config(tmp_path: Path, environment: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\npath = "unused"\n\n[task.environment]\n{environment}\n')
    return path


def test_env_step_is_built_by_position_or_keyword_and_exported() -> None:
    assert async_rl.EnvStep("3", 1.0, True) == async_rl.EnvStep(observation="3", reward=1.0,
                                                                  done=True)
    assert async_rl.EnvStep(None, 0.0, False).observation is None
    assert "EnvStep" in async_rl.__all__ and "Environment" in async_rl.__all__


def test_the_environment_table_round_trips_and_takes_three_part_overrides(
        tmp_path: Path) -> None:
    path = write_config(tmp_path, f'class = "{ADDER}"\nstop = ["</call>"]')
    config = load_config(path, ["task.environment.max_turns=3"])
    env = config.task.environment
    assert (env.class_, env.stop, env.max_turns, env.enabled) == (ADDER, ("</call>",), 3, True)
    assert decode_config(tomllib.loads(to_toml(config))) == config  # config.toml on resume
    assert not load_config(write_config(tmp_path, "")).task.environment.enabled


@pytest.mark.parametrize(("line", "key"), [
    ("bogus = 1", "task.environment"),
    ('stop = [""]', "task.environment.stop"),
    ("max_trajectory_tokens = 5000", "task.environment.max_trajectory_tokens"),
    ('on_timeout = "retry"', "task.environment.on_timeout"),
    ('[run]\neval_on = "idle_cpu"', "run.eval_on"),
])
def test_a_bad_environment_key_is_one_line_naming_it(tmp_path: Path, line: str,
                                                     key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        load_config(write_config(tmp_path, f'class = "{ADDER}"\n{line}'))
    assert "\n" not in str(err.value)


def test_the_class_loads_from_a_file_or_a_module_and_is_checked(tmp_path: Path) -> None:
    assert environment_class(EnvironmentConfig(class_=ADDER)).__name__ == "AdderEnv"
    assert environment_class(
        EnvironmentConfig(class_="tests.fixtures.adder_env:HangingAdderEnv"),
    ).__name__ == "HangingAdderEnv"
    (tmp_path / "bad_env.py").write_text(
        "class NoStep:\n    async def reset(self, row):\n        return ''\n"
        "class SyncStep:\n    async def reset(self, row):\n        return ''\n"
        "    def step(self, completion):\n        return None\n"
        "class NeedsArgs:\n    def __init__(self, x):\n        pass\n"
        "    async def reset(self, row):\n        return ''\n"
        "    async def step(self, completion):\n        return None\n"
        "not_a_class = 3\n")
    for name, why in [("NoStep", "async def step"), ("SyncStep", "async def step"),
                      ("NeedsArgs", "no arguments"), ("not_a_class", "not a class"),
                      ("Missing", "no 'Missing'")]:
        spec = EnvironmentConfig(class_=f"{tmp_path / 'bad_env.py'}:{name}")
        with pytest.raises(ConfigError, match=rf"task\.environment\.class = .*{why}"):
            environment_class(spec)
    with pytest.raises(ConfigError, match="file not found"):
        environment_class(EnvironmentConfig(class_="nowhere.py:Env"))


def test_check_inputs_names_the_class_before_anything_starts(tmp_path: Path) -> None:
    from async_rl.run.inputs import check_inputs

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    config = load_config(write_config(tmp_path, 'class = "nowhere.py:Env"'),
                         {"model.path": str(model)})
    with pytest.raises(ConfigError, match=r"task\.environment\.class"):
        check_inputs(config)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2",
                                                   "max_position_embeddings": 2048}))
    fits = load_config(write_config(tmp_path, f'class = "{ADDER}"'), {"model.path": str(model)})
    assert check_inputs(fits).task.environment.class_ == ADDER
    long = load_config(write_config(tmp_path, f'class = "{ADDER}"\nmax_trajectory_tokens = 3000'),
                       {"model.path": str(model)})
    with pytest.raises(ConfigError, match=r"max_trajectory_tokens = 3000: longer than"):
        check_inputs(long)
