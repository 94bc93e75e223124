"""The PPO dataflow on real Ray, the real vLLM CPU build and the tiny model.

- PPO with a critic and GAE, the KL to the reference in the reward, a warm-up step, and
  the reference and the critic on Ray workers of their own (placement "own"): 4 steps
  straight against 2 steps, SIGINT, ``--resume``, 2 more, at max_staleness 0 with seeded
  sampling: the same final policy and critic (weights and optimizer state). The straight
  run also shows the roles in the registry with processes of their own, in the idle
  accounting (the trainer's waits for them by cause) and the trace, the critic learning
  on its own worker and its update overlapping the policy's.
- PPO with the critic beside the policy, on FSDP2 over two trainer shards: critic
  metrics in every row, its sharded state in the checkpoint, one critic per shard in the
  registry, and its time in the idle accounting (the critic's idle while the policy
  computes, the trainer's while the critic does) and the trace.
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


LENGTH = "def length(completions, **kwargs):\n    return [len(c) / 10 for c in completions]\n"
"""A reward the tiny model's completions differ in from the first step: its arithmetic
accuracy is 0, and the KL in the reward is exactly 0 while the policy is its reference,
so without it the critic would have nothing to learn."""


def ppo(model_dir: Path, out: Path) -> Config:
    """PPO with both roles on workers of their own, the KL in the reward, a warm-up step."""
    rewards = out.parent / "length.py"
    rewards.write_text(LENGTH)
    return config(model_dir, out, algorithm={"advantage": "gae"},
                  critic={"lr": 1e-3, "gamma": 1.0, "lam": 0.95, "warmup_steps": 1,
                          "placement": "own"},
                  reference={"placement": "own"},
                  trainer={"kl_coef": 0.05, "kl_in_reward": True},
                  task={"rewards": [{"function": f"{rewards}:length"}]})


def critic_state(run_dir: Path) -> dict[str, Any]:
    folder, _ = latest_checkpoint(run_dir)
    state: dict[str, Any] = torch.load(folder / TRAINER / CRITIC_STATE, weights_only=True)
    return state


def spans_of(run_dir: Path, worker: str, causes: tuple[str, ...]) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run_dir / "spans.jsonl").read_text().splitlines()]
    # Spans are array-like records: worker, role, rank, device, cause, start, end, version.
    return [(r[5], r[6]) for r in rows if r[0] == worker and r[4] in causes]


def trace_categories(run_dir: Path) -> set[str]:
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {e.get("cat") for e in events}


def check_roles_of_their_own(out: Path) -> None:
    """The straight run's reference and critic: own processes, registry, idle, trace."""
    rows = read_metrics(out)
    for row in rows:
        assert row["kl/mean"] >= 0 and row["kl/max"] >= row["kl/mean"]
        assert row["critic/value_loss"] >= 0 and 0 <= row["critic/clip_fraction"] <= 1
    # A zero-initialised head values everything 0 until the critic's first update; it
    # learns on its own worker.
    assert rows[-1]["critic/value_mean"] != 0
    # The warm-up step fitted the critic and ran its prompts again for the policy.
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "dropped" and e.get("reason") == "critic_warmup"
               for e in ledger) == 4

    workers: list[dict[str, Any]] = json.loads((out / "workers.json").read_text())
    roles = {w["role"]: w for w in workers}
    assert [w["role"] for w in workers].count("critic") == 1
    pids = {w["role"]: w["pid"] for w in workers}
    assert len({pids["trainer"], pids["reference"], pids["critic"]}) == 3  # own processes
    assert roles["reference"]["node"] and roles["critic"]["node"]

    build_report(out)  # what async-rl train writes after the run
    idle = json.loads((out / "idle.json").read_text())
    by_role = {w["role"]: w for w in idle["workers"]}
    assert by_role["reference"]["busy_s"] > 0 and by_role["critic"]["busy_s"] > 0
    trainer_idle = by_role["trainer"]["idle_by_cause"]
    assert trainer_idle["wait_reference"] > 0 and trainer_idle["wait_critic"] > 0
    assert trainer_idle["critic"] == 0  # no critic computes on the trainer's device
    assert {"reference", "critic"} <= trace_categories(out)

    # The critic's update (its backward) overlaps the policy's update.
    critic = spans_of(out, "critic-0", ("backward",))
    policy = spans_of(out, "trainer-0", ("barrier", "forward", "backward", "optimizer"))
    assert len(critic) >= 3 and policy
    assert any(c0 < p1 and p0 < c1 for c0, c1 in critic for p0, p1 in policy)


def test_ppo_stops_and_resumes_to_the_same_policy_and_critic(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None
) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    summary = run_training(ppo(tiny_model_dir, straight))
    assert summary.final_version == STEPS
    assert [r["step"] for r in read_metrics(straight)] == list(range(1, STEPS + 1))
    check_roles_of_their_own(straight)

    signal_after_rows(resumed, 2, signal.SIGINT, os.getpid())
    first = run_training(ppo(tiny_model_dir, resumed))
    assert first.stopped == "SIGINT" and 2 <= first.steps < STEPS
    second = run_training(ppo(tiny_model_dir, resumed), resume=True)
    assert second.final_version == STEPS
    assert [r["step"] for r in read_metrics(resumed)] == list(range(1, STEPS + 1))
    assert trained(straight) == trained(resumed)
    a = load_file(straight / FINAL_MODEL / "model.safetensors")
    b = load_file(resumed / FINAL_MODEL / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    # The resumed critic continued from the checkpoint's state, optimizer included.
    ours, theirs = critic_state(straight), critic_state(resumed)
    assert ours["model"].keys() == theirs["model"].keys() and len(ours["model"]) > 0
    worst = max(float((ours["model"][k] - theirs["model"][k]).abs().max())
                for k in ours["model"])
    print(f"largest critic weight difference, straight vs stopped and resumed: {worst:.3g}")
    assert all(torch.allclose(ours["model"][k], theirs["model"][k], rtol=1e-4, atol=1e-6)
               for k in ours["model"]), worst
    steps = [s["step"] for s in ours["optimizer"]["state"].values()]
    assert steps and steps == [s["step"] for s in theirs["optimizer"]["state"].values()]
    assert float(steps[0]) > STEPS  # the warm-up's updates and one a step, not a fresh count


def test_ppo_on_two_fsdp2_shards_trains_and_checkpoints_the_sharded_critic(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None
) -> None:
    """The critic sharded by FSDP2 over two trainer shards, beside the policy, in a real
    run: its metrics in every row, its sharded state in the checkpoint, its time in the
    idle accounting and the trace (its arithmetic against DDP's and its exact resume:
    ``tests/unit/test_critic_shards.py``)."""
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
    # The critic is a role beside the policy: in the idle accounting and the trace.
    build_report(out)
    idle = json.loads((out / "idle.json").read_text())
    critics = [w for w in idle["workers"] if w["role"] == "critic"]
    assert len(critics) == 2 and all(c["busy_s"] > 0 for c in critics)
    assert all(c["idle_by_cause"]["policy"] > 0 for c in critics)
    trainers = [w for w in idle["workers"] if w["role"] == "trainer"]
    assert len(trainers) == 2 and all(t["idle_by_cause"]["critic"] > 0 for t in trainers)
    assert "critic" in trace_categories(out)
