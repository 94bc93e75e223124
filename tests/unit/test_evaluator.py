"""The idle-CPU evaluator (run.eval_on = "idle_cpu") on a tiny local model, no Ray: it
scores the weights it is handed, not the ones it loaded, labels them with their version,
counts a failing reward as 0, and runs at the OS's idle priority."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl.models.tiny_model import MadeModel, make_model
from async_rl.tasks.rewards import arithmetic_reward
from async_rl.tasks.sources import ArithmeticTask
from buffers.common.records import Prompt
from buffers.common.reports import EvalResult
from workers.eval.evaluator import EVALUATOR_RANK, IdleCpuEvaluator
from workers.eval.greedy import evaluate_accuracy
from workers.eval.spec import EvaluatorSpec
from workers.model_config import ModelConfig
from workers.rollout.task import WorkerTask

PROMPTS = ArithmeticTask(seed=0).eval_prompts(24)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> MadeModel:
    return make_model(tmp_path_factory.mktemp("tiny"), seed=0, sft_steps=30, eval_size=16,
                      log=None)


def in_a_thread(evaluator: IdleCpuEvaluator, state: dict[str, torch.Tensor],
                version: int) -> tuple[EvalResult, int]:
    """Set up and evaluate on a thread of its own (idle priority is per thread, and must
    not reach the test runner's); returns the result and the thread's policy."""
    out: list[tuple[EvalResult, int]] = []

    def work() -> None:
        evaluator.setup()
        result = evaluator.evaluate(PROMPTS, state, version)
        out.append((result, os.sched_getscheduler(0)))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert len(out) == 1
    return out[0]


def test_scores_the_weights_it_is_handed_at_idle_priority(made: MadeModel) -> None:
    tokenizer = AutoTokenizer.from_pretrained(made.path)
    other = AutoModelForCausalLM.from_pretrained(made.path)
    with torch.no_grad():  # another policy than the one on disk
        for param in other.parameters():
            param.add_(torch.randn_like(param) * 0.05, alpha=1.0)
    state = {k: v.clone() for k, v in other.state_dict().items()}
    expected = evaluate_accuracy(other, tokenizer, PROMPTS, arithmetic_reward,
                                 max_new_tokens=6)
    on_disk = evaluate_accuracy(AutoModelForCausalLM.from_pretrained(made.path), tokenizer,
                                PROMPTS, arithmetic_reward, max_new_tokens=6)
    assert expected != on_disk  # so the check below tells the two apart

    evaluator = IdleCpuEvaluator(
        EvaluatorSpec(model=ModelConfig(path=made.path), max_new_tokens=6),
        WorkerTask(reward_fn=arithmetic_reward))
    result, policy = in_a_thread(evaluator, state, version=7)
    assert result.accuracy == expected
    assert (result.version_min, result.version_max) == (7, 7)
    assert result.num_prompts == len(PROMPTS) and result.rollout_rank == EVALUATOR_RANK
    assert result.seconds > 0
    assert policy == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the test's own thread untouched


def test_a_failing_reward_scores_zero_and_is_counted(made: MadeModel) -> None:
    def reward(prompt: Prompt, text: str) -> float:
        if prompt.prompt_id.endswith("3"):
            raise RuntimeError("bug in the reward")
        return float("nan") if prompt.prompt_id.endswith("5") else 1.0

    evaluator = IdleCpuEvaluator(
        EvaluatorSpec(model=ModelConfig(path=made.path), max_new_tokens=2),
        WorkerTask(reward_fn=reward))
    state = AutoModelForCausalLM.from_pretrained(made.path).state_dict()
    result, _ = in_a_thread(evaluator, state, version=0)
    bad = [p for p in PROMPTS if p.prompt_id.endswith(("3", "5"))]
    assert bad and evaluator.reward_failures == len(bad)
    assert result.accuracy == pytest.approx(1 - len(bad) / len(PROMPTS))


def test_no_prompts_is_an_error(made: MadeModel) -> None:
    evaluator = IdleCpuEvaluator(
        EvaluatorSpec(model=ModelConfig(path=made.path), max_new_tokens=2),
        WorkerTask(reward_fn=arithmetic_reward))
    with pytest.raises(ValueError, match="at least one prompt"):
        evaluator.evaluate([], {}, 0)
