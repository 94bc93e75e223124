"""task.answer_key and the columns rewards see (issue 40, defects 6 and 7): the answer
key's column reaches the rewards under its own name as well as ``answer`` (verl's
``ground_truth``), so a TRL reward that reads ``solution`` runs unchanged; with
``answer_key = ""`` a column named ``answer`` reaches them as it is. Real reward
functions of each style, loaded from a file, over a JSONL dataset, scored by the
rollout side's ``Scorer`` (its thread pool: the binding is the processes' own)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from async_rl.config import task_config
from async_rl.tasks.dataset import Fit, load_dataset_task
from buffers.common.records import Prompt, Sample
from workers.rewards.runner import UserRewards
from workers.rewards.spec import RewardSpec
from workers.rollout.prompts import PromptFormat
from workers.rollout.scoring import Scorer

ALL = Fit(tokenizer=None, fmt=PromptFormat(), context=0, max_new_tokens=8)

REWARDS = '''
def accuracy_reward(completions, solution, **kwargs):
    """TRL's accuracy_reward, as its users write it (conversational completions)."""
    contents = [completion[0]["content"] for completion in completions]
    return [float(c.strip() == str(s)) for c, s in zip(contents, solution)]


def trl_answer(completions, answer, **kwargs):
    """A TRL-style reward reading ``answer``; it also checks what else came."""
    assert set(kwargs) >= {"prompts", "completion_ids", "level"}, sorted(kwargs)
    return [float(c[0]["content"] == str(a)) for c, a in zip(completions, answer)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's compute_score."""
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0


def per_sample(prompt, completion, answer, **columns):
    """A per-sample reward; the answer must come as the dataset holds it."""
    return float(completion == str(answer)) + (10.0 if not isinstance(answer, str) else 0.0)
'''

ALL_STYLES = ("accuracy_reward", "trl_answer", "compute_score", "per_sample")


def write_rows(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def score(tmp_path: Path, names: tuple[str, ...], columns: tuple[str, ...], prompt: Prompt,
          completions: list[str]) -> dict[str, float]:
    """Each reward's mean over ``completions`` of ``prompt``, scored as a rollout worker
    scores (chat on: TRL-style rewards get messages)."""
    file = tmp_path / "rewards.py"
    file.write_text(REWARDS)
    user = UserRewards(specs=tuple(RewardSpec(function=f"{file}:{n}") for n in names),
                       threads=True, chat=True, columns=columns)
    scorer = Scorer(lambda p, c: 0.0, user)
    scorer.start()
    try:
        samples = [Sample(token_ids=(1,), logprobs=(0.0,), versions=(0,),
                          finish_reason="stop", text=text) for text in completions]
        scored = asyncio.run(scorer.score(prompt, samples))
    finally:
        scorer.close()
    assert scored.errors == 0 and scored.timeouts == 0
    assert all(None not in values for values in scored.scores.values())
    return {name: sum(v or 0.0 for v in values) / len(values)
            for name, values in scored.scores.items()}


def test_the_answer_keys_column_reaches_rewards_by_its_own_name(tmp_path: Path) -> None:
    rows = [{"question": "2+2=", "solution": "4", "level": 1}]
    config = task_config(kind="dataset", path=str(write_rows(tmp_path, rows)),
                        prompt_key="question", answer_key="solution")
    source = load_dataset_task(config, ALL).source
    assert source.columns == ("answer", "solution", "level")
    prompt = source.prompt_at(0)
    assert prompt.answer == "4" and prompt.columns == {"solution": "4", "level": 1}
    means = score(tmp_path, ALL_STYLES, source.columns, prompt, ["4", "5", "4", "x"])
    # TRL's own accuracy_reward (solution), answer, verl's ground_truth: one value.
    assert means == {"accuracy_reward": 0.5, "trl_answer": 0.5, "compute_score": 0.5,
                     "per_sample": 0.5}


def test_no_answer_key_keeps_an_answer_column_as_it_is(tmp_path: Path) -> None:
    rows = [{"question": "6*7=", "answer": 42, "level": 2}]
    config = task_config(kind="dataset", path=str(write_rows(tmp_path, rows)),
                        prompt_key="question", answer_key="",
                        rewards=(RewardSpec(function="rewards.py:per_sample"),))
    source = load_dataset_task(config, ALL).source
    assert source.columns == ("answer", "level")
    prompt = source.prompt_at(0)
    assert prompt.answer == "" and prompt.columns == {"answer": 42, "level": 2}
    names = ("trl_answer", "compute_score", "per_sample")
    means = score(tmp_path, names, source.columns, prompt, ["42", "41"])
    # 42 reaches them, not "": per_sample's +10 says it came as the number it is.
    assert means == {"trl_answer": 0.5, "compute_score": 0.5, "per_sample": 10.5}


@pytest.mark.parametrize(("answer_key", "row", "answer", "columns"), [
    # An answer column beside the answer key: ``answer`` is the answer key's value.
    ("solution", {"q": "a", "solution": "7", "answer": "other"}, "7", {"solution": "7"}),
    # A missing value: no answer, the column as read.
    ("solution", {"q": "a", "solution": None}, "", {"solution": None}),
    # The usual column name: as before, once.
    ("answer", {"q": "a", "answer": 3}, "3", {}),
    # Neither an answer key nor an answer column: rewards get answer = "".
    ("", {"q": "a", "level": 0}, "", {"level": 0}),
])
def test_answer_and_columns_of_each_key(tmp_path: Path, answer_key: str,
                                        row: dict[str, Any], answer: str,
                                        columns: dict[str, Any]) -> None:
    config = task_config(kind="dataset", path=str(write_rows(tmp_path, [row, row])),
                        prompt_key="q", answer_key=answer_key,
                        rewards=(RewardSpec(function="rewards.py:per_sample"),))
    source = load_dataset_task(config, ALL).source
    prompt = source.prompt_at(0)
    assert prompt.answer == answer and prompt.columns == columns
    assert source.columns == ("answer", *columns)
