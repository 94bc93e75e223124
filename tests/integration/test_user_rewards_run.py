"""The task's own reward functions (task.rewards) in a real run: real Ray, the real vLLM
CPU build and the tiny local model.

A TRL-style and a verl-style reward from a file outside the package score every group
of a Parquet dataset with columns of its own names, rendered by the tokenizer's chat
template (the prompt token ids the engine saw are the template's); each one's mean is
logged per step as reward/<name>, and a reward that never returns on some calls costs
those scores only: the run finishes every step, the timeouts are counted, and the
ledger shows no prompt lost or trained twice (one run for all of it: a Ray and vLLM
start is most of a run's time here). A reward that hangs across a Ctrl-C and a resume:
``test_environment_run.py`` (one run with a hanging environment)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import ray
from test_async_grpo import check_ledger, small_config
from transformers import AutoTokenizer

from async_rl.cli import main
from async_rl.run.run_dir import read_evals, read_ledger, read_metrics
from async_rl.shell.ray_shell import LOCAL_RAY_SYSTEM, run_training
from buffers.common.records import Prompt
from workers import layout
from workers.model_config import ModelConfig
from workers.rewards.runner import UserRewards
from workers.rewards.spec import RewardSpec
from workers.rollout.config import RolloutConfig
from workers.rollout.prompts import PromptFormat, conversation
from workers.rollout.spec import RolloutSpec
from workers.rollout.task import WorkerTask
from workers.rollout.worker import RolloutWorker
from workers.weights.config import WeightsConfig

pytestmark = pytest.mark.ray

def test_a_reward_that_does_not_import_exits_2_naming_the_key(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("import no_such_module_anywhere\n")
    config = tmp_path / "config.toml"
    config.write_text(f'[model]\npath = "{tiny_model_dir}"\n'
                      f'[run]\noutput_dir = "{tmp_path / "run"}"\n'
                      f'[[task.rewards]]\nfunction = "{bad}:score"\n')
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("config error: task.rewards[0].function = ")
    assert "no_such_module_anywhere" in err[0]


CHAT_REWARDS = '''
import hashlib
import time


def correctness(prompts, completions, answer, **kwargs):
    """TRL style, chat templates on: message lists, and the dataset's columns as lists."""
    assert prompts[0][0] == {"role": "system", "content": "Answer with a number."}
    assert prompts[0][-1]["role"] == "user" and len(kwargs["level"]) == len(completions)
    return [1.0 if c[0]["content"].strip().startswith(a) else 0.0
            for c, a in zip(completions, answer)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl style: the row's data_source column, the answer as ground_truth."""
    assert data_source == "sums" and isinstance(extra_info["level"], int)
    return {"score": 1.0 if solution_str.strip().startswith(ground_truth) else 0.0,
            "length": float(len(solution_str))}


def hangs_sometimes(prompt, completion, answer):
    """Per-sample style; never returns for about 1 completion in 8."""
    key = hashlib.sha256((str(prompt) + str(completion)).encode()).digest()[0]
    if key % 8 == 0:
        time.sleep(3600)
    return 0.0
'''
SYSTEM = "Answer with a number."


def sums_parquet(tmp_path: Path) -> Path:
    """A GSM8K-like file: the prompt and answer under other names, two more columns."""
    path = tmp_path / "sums.parquet"
    pd.DataFrame([{"question": f"{a}+{b}=", "solution": str(a + b), "level": a % 3,
                   "data_source": "sums"} for a in range(10) for b in range(3)]
                 ).to_parquet(path)
    return path


def test_trl_and_verl_rewards_score_a_parquet_dataset_and_a_hanging_one_costs_its_scores(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None,
) -> None:
    rewards = tmp_path / "chat_rewards.py"
    rewards.write_text(CHAT_REWARDS)
    out = tmp_path / "run"
    config = small_config(tiny_model_dir, out, max_staleness=1, task={
        "kind": "dataset", "path": str(sums_parquet(tmp_path)), "prompt_key": "question",
        "answer_key": "solution", "eval_fraction": 0.1, "eval_size": 3,
        "chat_template": True, "system_prompt": SYSTEM, "eval_reward": "compute_score",
        "reward_timeout_s": 1.0, "reward_workers": 2,
        "rewards": [{"function": f"{rewards}:correctness", "weight": 1.0},
                    {"function": f"{rewards}:compute_score", "weight": 0.5},
                    {"function": f"{rewards}:hangs_sometimes", "weight": 1.0}]},
        run={"num_steps": 4, "eval_on": "idle_cpu"})
    summary = run_training(config)
    assert summary.steps == 4 and summary.groups_trained == 4 * 4
    assert summary.failures["reward_timeouts"] > 0
    # The chat rewards assert what they are handed: an error would count here.
    assert summary.failures.get("reward_errors", 0) == 0
    check_ledger(out, summary.groups_trained)
    assert all(e.prompt_id.startswith("sums-") for e in read_ledger(out))
    rows = read_metrics(out)
    assert len(rows) == 4
    for row in rows:
        assert 0.0 <= row["reward/correctness"] <= 1.0
        assert 0.0 <= row["reward/compute_score"] <= 1.0
        assert row["reward/compute_score/length"] > 0.0
        assert row["reward/hangs_sometimes"] == 0.0
    # The weighted sum is what was trained on: correctness + 0.5 * compute_score.
    assert max(row["reward_mean"] for row in rows) <= 1.5
    evals = read_evals(out)
    assert len(evals) == 2 and all(r.num_prompts == 3 for r in evals)
    assert all(0.0 <= r.accuracy <= 1.0 for r in evals)


def test_the_engine_sees_the_chat_templates_prompt_token_ids(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None,
) -> None:
    rewards = tmp_path / "chat_rewards.py"
    rewards.write_text(CHAT_REWARDS)
    fmt = PromptFormat(chat_template=True, system_prompt=SYSTEM)
    ray.init(num_cpus=1, include_dashboard=False, address="local",
             _system_config=LOCAL_RAY_SYSTEM)
    worker = ray.remote(RolloutWorker).options(num_cpus=1, max_concurrency=16).remote(
        RolloutSpec(rank=0, model=ModelConfig(path=str(tiny_model_dir)),
                    rollout=RolloutConfig(group_size=2, max_new_tokens=4, max_inflight_prompts=1),
                    weights=WeightsConfig(transport="gloo"),
                    cpu_ids=layout.usable_cores()[:1]),
        WorkerTask(
            reward_fn=lambda p, c: 0.0, prompt_format=fmt,
            user_rewards=UserRewards(specs=(RewardSpec(function=f"{rewards}:compute_score"),),
                                     threads=True, chat=True, columns=("answer", "level"))))
    ray.get(worker.start.remote(), timeout=300)
    prompt = Prompt(prompt_id="sums-0", text="3+4=", answer="7", columns={"level": 1},
                    data_source="sums")
    group = ray.get(worker.generate_group.remote(prompt), timeout=120)
    expected = AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        conversation(prompt, SYSTEM), add_generation_prompt=True, return_dict=False)
    assert group.tokens.prompt_token_ids.tolist() == list(expected)
    assert group.prompt_length == len(expected) and group.reward_failures == 0
    ray.get(worker.shutdown.remote(), timeout=60)
