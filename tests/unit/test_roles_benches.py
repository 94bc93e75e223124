"""bench/algorithms/roles.py's arms at other KL coefficients (without training) and
bench/simulator/sim_roles.py's simulated arms (a few steps of the 7B layout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_modules import load_script

from async_rl.config import Config

roles = load_script("bench/algorithms/roles.py", "roles_bench")
sim_roles = load_script("bench/simulator/sim_roles.py", "sim_roles_bench")


def test_kl_coefs_replace_the_kl_arm_with_one_arm_each(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    measured: list[tuple[str, Config]] = []

    def measure(task: str, arm: str, config: Config) -> object:
        measured.append((arm, config))
        return roles.ArmFigures(task=task, arm=arm, overrides=(), run_dir="", steps=0,
                                samples=0, wall_s=0.0, accuracy_start=None,
                                accuracy_end=None, groups_per_s=0.0, kl_mean=None, idle={},
                                bytes_per_version=0)

    monkeypatch.setattr(roles, "measure", measure)
    assert roles.main(["--tasks", "cpu_default", "--arms", "grpo", "grpo+kl", "--kl-coefs",
                       "0.5", "1.0", "--steps", "3", "--out-dir", str(tmp_path)]) == 0
    assert [arm for arm, _ in measured] == ["grpo", "grpo+kl0.5", "grpo+kl1"]
    (_, zero), (_, half), (_, one) = measured
    assert (zero.trainer.kl_coef, half.trainer.kl_coef, one.trainer.kl_coef) == (0.0, 0.5, 1.0)
    assert half.trainer.kl_estimator == one.trainer.kl_estimator == "k3"
    assert zero.has_reference  # the KL measured at kl_coef = 0 too
    assert {c.run.num_steps for _, c in measured} == {3}
    assert len({c.run.output_dir for _, c in measured}) == 3


def test_the_simulated_arms_show_the_critic_and_the_adapters_bytes(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_roles.main(["--json", "--set", "run.num_steps=4"]) == 0
    arms = {a["arm"]: a for a in json.loads(capsys.readouterr().out)["arms"]}
    assert set(arms) == {"grpo", "grpo+kl", "ppo", "grpo+lora"}
    full = arms["grpo"]["bytes_per_version"]
    assert full == pytest.approx(7.6e9 * 2)  # bf16
    assert arms["grpo+lora"]["bytes_per_version"] == 8 * sim_roles.LORA_PER_RANK * 2
    assert arms["ppo"]["trainer_idle"]["critic"] > 0.1 and arms["ppo"]["critic_busy"] > 0.1
    assert arms["grpo"]["trainer_idle"].get("critic", 0.0) == 0.0
    assert arms["grpo"]["critic_busy"] is None
    assert arms["ppo"]["train_s"] > arms["grpo+kl"]["train_s"] > arms["grpo"]["train_s"]
