"""The PPO dataflow on real Ray, the real vLLM CPU build and the tiny model.

- PPO with a critic and GAE (and the KL in the reward, a warm-up step): 4 steps
  straight against 2 steps, SIGINT, ``--resume``, 2 more, at max_staleness 0 with seeded
  sampling: the same final policy and critic (weights and optimizer state), the critic
  in the registry, the idle accounting and the trace.
- PPO with the critic on FSDP2 over two trainer shards: critic metrics in every row,
  its sharded state in the checkpoint, one critic per shard in the registry.
GRPO with the KL term in the loss to a reference of its own (reference.path) is
``test_stop_resume.py``'s run (stopped, resumed, and straight).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_stop_resume import signal_after_rows, trained

from async_rl.analysis.report import build_report
from async_rl.config import Config
from async_rl.config_io import decode_config
from async_rl.control.checkpoint_files import TRAINER, latest_checkpoint
from async_rl.run.run_dir import FINAL_MODEL, read_metrics
from async_rl.shell.ray_shell import run_training
from workers.trainer.critic import CRITIC_SHARDED, CRITIC_STATE

pytestmark = pytest.mark.ray

STEPS = 4


def config(model_dir: Path, out: Path, **sections: dict[str, Any]) -> Config:
    base: dict[str, Any] = {
        "model": {"path": str(model_dir)},
        "task": {"eval_size": 0},
        "rollout": {"group_size": 4, "max_new_tokens": 6, "max_inflight_prompts": 4,
                    "sampling_seed": 7},
        "staleness": {"max_staleness": 0},
        "trainer": {"groups_per_step": 4, "micro_batch_tokens": 512, "lr": 1e-4},
        "run": {"num_steps": STEPS, "output_dir": str(out), "progress": False},
    }
    for name, values in sections.items():
        base[name] = base.get(name, {}) | values
    return decode_config(base)


def ppo(model_dir: Path, out: Path) -> Config:
    return config(model_dir, out, algorithm={"advantage": "gae"},
                  critic={"lr": 1e-3, "gamma": 1.0, "lam": 0.95, "warmup_steps": 1},
                  trainer={"kl_coef": 0.05, "kl_in_reward": True})


def critic_state(run_dir: Path) -> dict[str, Any]:
    folder, _ = latest_checkpoint(run_dir)
    state: dict[str, Any] = torch.load(folder / TRAINER / CRITIC_STATE, weights_only=True)
    return state


def test_ppo_stops_and_resumes_to_the_same_policy_and_critic(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None
) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    summary = run_training(ppo(tiny_model_dir, straight))
    assert summary.final_version == STEPS
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["critic/value_loss"] >= 0 and row["kl/mean"] >= 0
        assert 0 <= row["critic/clip_fraction"] <= 1
    # The warm-up step fitted the critic and ran its prompts again for the policy.
    ledger = [json.loads(line) for line in (straight / "ledger.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "dropped" and e.get("reason") == "critic_warmup"
               for e in ledger) == 4
    # The critic is a role: in the registry, the idle accounting and the trace.
    workers = json.loads((straight / "workers.json").read_text())
    assert [w["role"] for w in workers].count("critic") == 1
    build_report(straight)  # what async-rl train writes after the run
    idle = json.loads((straight / "idle.json").read_text())
    critic = [w for w in idle["workers"] if w["role"] == "critic"]
    assert len(critic) == 1 and critic[0]["busy_s"] > 0
    assert critic[0]["idle_by_cause"]["policy"] > 0
    trainer = next(w for w in idle["workers"] if w["role"] == "trainer")
    assert trainer["idle_by_cause"]["critic"] > 0
    trace = json.loads((straight / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert any(e.get("cat") == "critic" for e in events)

    signal_after_rows(resumed, 2, signal.SIGINT, os.getpid())
    first = run_training(ppo(tiny_model_dir, resumed))
    assert first.stopped == "SIGINT" and 2 <= first.steps < STEPS
    second = run_training(ppo(tiny_model_dir, resumed), resume=True)
    assert second.final_version == STEPS
    assert trained(straight) == trained(resumed)
    a = load_file(straight / FINAL_MODEL / "model.safetensors")
    b = load_file(resumed / FINAL_MODEL / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    ours, theirs = critic_state(straight), critic_state(resumed)
    assert ours["model"].keys() == theirs["model"].keys() and len(ours["model"]) > 0
    worst = max(float((ours["model"][k] - theirs["model"][k]).abs().max())
                for k in ours["model"])
    print(f"largest critic weight difference, straight vs stopped and resumed: {worst:.3g}")
    assert all(torch.allclose(ours["model"][k], theirs["model"][k], rtol=1e-4, atol=1e-6)
               for k in ours["model"]), worst
    steps = [s["step"] for s in ours["optimizer"]["state"].values()]
    assert steps and steps == [s["step"] for s in theirs["optimizer"]["state"].values()]


def test_ppo_on_two_fsdp2_shards_trains_and_checkpoints_the_sharded_critic(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None
) -> None:
    """The critic sharded by FSDP2 over two trainer shards, in a real run: its metrics in
    every row and its sharded state in the checkpoint (its arithmetic against DDP's and
    its exact resume: ``tests/unit/test_critic_shards.py``)."""
    out = tmp_path / "fsdp2"
    steps = 2
    run_training(config(tiny_model_dir, out, algorithm={"advantage": "gae"},
                        critic={"num_shards": 2, "lr": 1e-3},
                        trainer={"backend": "fsdp2", "num_shards": 2},
                        run={"num_steps": steps}))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert row["critic/value_loss"] >= 0 and 0 <= row["critic/clip_fraction"] <= 1
        assert row["critic/grad_norm"] >= 0 and row["critic/update_s"] > 0
    folder, _ = latest_checkpoint(out)
    assert (folder / TRAINER / CRITIC_SHARDED).is_dir()
    assert not (folder / TRAINER / CRITIC_STATE).exists()
    workers = json.loads((out / "workers.json").read_text())
    assert [w["role"] for w in workers].count("critic") == 2
