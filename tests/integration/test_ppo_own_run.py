"""PPO with the reference and the critic on Ray workers of their own (placement "own"),
on real Ray, the real vLLM CPU build and the tiny model: 3 steps, then ``--resume`` to 5.

The roles are in the registry with processes of their own, in the idle accounting (the
trainer's waits for them by cause) and the trace; every row has the KL and the critic's
metrics; the critic learns on its own worker (its values leave the zero-initialised
head's 0) and its update overlaps the policy's; the resumed run continues the critic's
state from the checkpoint (its optimizer counts 5 updates, not 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_ppo_run import config

from async_rl.analysis.report import build_report
from async_rl.config import Config
from async_rl.control.checkpoint_files import TRAINER, latest_checkpoint
from async_rl.run.run_dir import read_metrics
from async_rl.shell.ray_shell import run_training
from workers.trainer.critic import CRITIC_STATE

pytestmark = pytest.mark.ray


LENGTH = "def length(completions, **kwargs):\n    return [len(c) / 10 for c in completions]\n"
"""A reward the tiny model's completions differ in from the first step: its arithmetic
accuracy is 0, and the KL in the reward is exactly 0 while the policy is its reference,
so without it nothing would move."""


def own(model_dir: Path, out: Path, steps: int) -> Config:
    rewards = out.parent / "length.py"
    rewards.write_text(LENGTH)
    return config(model_dir, out, algorithm={"advantage": "gae"},
                  critic={"lr": 1e-3, "lam": 0.95, "placement": "own"},
                  reference={"placement": "own"},
                  trainer={"kl_coef": 0.05, "kl_in_reward": True},
                  task={"rewards": [{"function": f"{rewards}:length"}]},
                  run={"num_steps": steps})


def spans_of(run_dir: Path, worker: str, causes: tuple[str, ...]) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run_dir / "spans.jsonl").read_text().splitlines()]
    # Spans are array-like records: worker, role, rank, device, cause, start, end, version.
    return [(r[5], r[6]) for r in rows if r[0] == worker and r[4] in causes]


def test_ppo_with_roles_on_workers_of_their_own_trains_and_resumes(
        tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None) -> None:
    out = tmp_path / "own"
    summary = run_training(own(tiny_model_dir, out, steps=3))
    assert summary.final_version == 3
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["kl/mean"] >= 0 and row["kl/max"] >= row["kl/mean"]
        assert row["critic/value_loss"] >= 0 and 0 <= row["critic/clip_fraction"] <= 1
    # A zero-initialised head values everything 0 until the critic's first update.
    assert rows[0]["critic/value_mean"] == 0 and rows[-1]["critic/value_mean"] != 0

    workers: list[dict[str, Any]] = json.loads((out / "workers.json").read_text())
    roles = {w["role"]: w for w in workers}
    assert [w["role"] for w in workers].count("critic") == 1
    pids = {w["role"]: w["pid"] for w in workers}
    assert len({pids["trainer"], pids["reference"], pids["critic"]}) == 3  # own processes
    assert roles["reference"]["node"] and roles["critic"]["node"]

    build_report(out)
    idle = json.loads((out / "idle.json").read_text())
    by_role = {w["role"]: w for w in idle["workers"]}
    assert by_role["reference"]["busy_s"] > 0 and by_role["critic"]["busy_s"] > 0
    trainer_idle = by_role["trainer"]["idle_by_cause"]
    assert trainer_idle["wait_reference"] > 0 and trainer_idle["wait_critic"] > 0
    assert trainer_idle["critic"] == 0  # no critic computes on the trainer's device
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert {"reference", "critic"} <= {e.get("cat") for e in events}

    # The critic's update (its backward) overlaps the policy's update.
    critic = spans_of(out, "critic-0", ("backward",))
    policy = spans_of(out, "trainer-0", ("barrier", "forward", "backward", "optimizer"))
    assert len(critic) >= 3 and policy
    assert any(c0 < p1 and p0 < c1 for c0, c1 in critic for p0, p1 in policy)

    folder, _ = latest_checkpoint(out)
    assert (folder / TRAINER / CRITIC_STATE).is_file()

    resumed = run_training(own(tiny_model_dir, out, steps=5), resume=True)
    assert resumed.final_version == 5
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]
    folder, _ = latest_checkpoint(out)
    state = torch.load(folder / TRAINER / CRITIC_STATE, weights_only=True)
    steps = [float(s["step"]) for s in state["optimizer"]["state"].values()]
    assert steps and set(steps) == {5.0}  # 3 updates before the checkpoint, 2 after
