"""task.kind = "dataset": every format the datasets library reads, the column mapping,
chat messages, the seeded shuffle per pass and exact resume, the held-out split, too-long
prompts refused with a count, bad input as one line naming the key, and the rendering
and scoring the rollout side does with a chat template (no Ray, no engine)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd
import pytest

from async_rl.cli import main
from async_rl.config import Config, TaskConfig, task_config
from async_rl.config_io import decode_config
from async_rl.models.tiny_model import build_tokenizer
from async_rl.run.inputs import check_inputs
from async_rl.tasks.dataset import Fit, load_dataset_task, model_fit
from async_rl.tasks.sources import SourceMismatchError
from buffers.common.config import ConfigError
from buffers.common.records import Prompt, Sample
from workers.rewards.runner import UserRewards
from workers.rewards.spec import RewardSpec
from workers.rollout.prompts import PromptFormat, conversation, prompt_tokens, render
from workers.rollout.scoring import Scorer

ROWS = [{"question": f"{i}+1=", "solution": str(i + 1), "level": i % 3,
         "data_source": "sums"} for i in range(10)]
ALL = Fit(tokenizer=None, fmt=PromptFormat(), context=0, max_new_tokens=8)
"""A fit that refuses nothing (no context known)."""


def write(tmp_path: Path, fmt: str, rows: list[dict[str, Any]] = ROWS,
          name: str = "train") -> Path:
    """``rows`` in format ``fmt`` (a file suffix, or "dir" for save_to_disk)."""
    frame = pd.DataFrame(rows)
    path = tmp_path / (name if fmt == "dir" else f"{name}.{fmt}")
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        frame.to_parquet(path)
    elif fmt == "csv":
        frame.to_csv(path, index=False)
    else:
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def task(path: Path | str, **kw: Any) -> TaskConfig:
    return task_config(kind="dataset", path=str(path), prompt_key="question",
                      answer_key="solution", **kw)


def tokenizer_dir(tmp_path: Path, chat: bool = True) -> Path:
    """A model directory with the tiny models' tokenizer (and a config.json)."""
    model = tmp_path / ("model" if chat else "model-no-chat")
    tokenizer = build_tokenizer()
    if not chat:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(model)
    (model / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "max_position_embeddings": 64}))
    return model


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "dir"])
def test_every_format_reads_with_its_columns_mapped(tmp_path: Path, fmt: str) -> None:
    data = load_dataset_task(task(write(tmp_path, fmt)), ALL)
    assert len(data.source) == 10
    prompts = [data.source.prompt_at(i) for i in range(10)]
    assert sorted(p.text for p in prompts) == sorted(r["question"] for r in ROWS)
    by_text = {r["question"]: r for r in ROWS}
    for prompt in prompts:
        row = by_text[prompt.text]
        assert prompt.answer == row["solution"]
        # Every column but the prompt reaches the rewards, the answer's by its own name
        # too (as read: CSV's are numbers); rewards get it as ``answer`` besides.
        solution = prompt.columns["solution"]
        assert str(solution) == row["solution"]
        assert prompt.columns == {"solution": solution, "level": row["level"],
                                  "data_source": "sums"}
        assert prompt.data_source == "train" and not prompt.messages
    assert data.source.columns == ("answer", "solution", "level", "data_source")
    assert [p.prompt_id for p in prompts[:2]] == ["train-0", "train-1"]


def test_a_datasetdict_directory_reads_its_train_split(tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:4]),
                          "test": datasets.Dataset.from_list(ROWS[4:])}).save_to_disk(str(path))
    assert len(load_dataset_task(task(path), ALL).source) == 4


def test_a_messages_column_gives_chat_prompts(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "system", "content": "Add."},
                          {"role": "user", "content": f"{i}+2="}], "answer": i + 2}
            for i in range(3)]
    path = write(tmp_path, "jsonl", rows)
    config = task_config(kind="dataset", path=str(path), prompt_key="messages",
                        chat_template=True)
    data = load_dataset_task(config, ALL)
    prompt = data.source.prompt_at(0)
    assert len(prompt.messages) == 2 and prompt.messages[0] == {"role": "system",
                                                                 "content": "Add."}
    assert prompt.text == prompt.messages[1]["content"]
    assert prompt.answer == str(int(prompt.text.split("+")[0]) + 2)  # numbers become text
    with pytest.raises(ConfigError, match=r"task\.prompt_key = 'messages'.*chat_template"):
        load_dataset_task(msgspec.structs.replace(config, chat_template=False), ALL)


def test_each_pass_is_a_new_seeded_permutation_and_resume_is_exact(tmp_path: Path) -> None:
    path = write(tmp_path, "parquet")
    source = load_dataset_task(task(path, seed=3), ALL).source
    passes = [[source.next_prompt().text for _ in range(10)] for _ in range(3)]
    for p in passes:
        assert sorted(p) == sorted(r["question"] for r in ROWS)
    assert passes[0] != passes[1] and passes[1] != passes[2]
    again = load_dataset_task(task(path, seed=3), ALL).source
    assert [again.next_prompt().text for _ in range(10)] == passes[0]
    other_seed = load_dataset_task(task(path, seed=4), ALL).source
    assert [other_seed.next_prompt().text for _ in range(10)] != passes[0]

    resumed = load_dataset_task(task(path, seed=3), ALL).source
    for _ in range(13):
        resumed.next_prompt()
    state = msgspec.json.decode(msgspec.json.encode(resumed.state()), type=type(resumed.state()))
    fresh = load_dataset_task(task(path, seed=3), ALL).source
    fresh.restore(state)
    assert state.next_index == 13
    assert [fresh.next_prompt() for _ in range(12)] == [resumed.next_prompt() for _ in range(12)]

    # Another file content (or another split) is another source: its cursor is refused.
    write(tmp_path, "parquet", [*ROWS, {**ROWS[0], "question": "99+1="}])
    changed = load_dataset_task(task(path, seed=3), ALL).source
    with pytest.raises(SourceMismatchError):
        changed.restore(state)
    split = load_dataset_task(task(path, seed=3, eval_fraction=0.2), ALL).source
    with pytest.raises(SourceMismatchError):
        split.restore(state)


def test_the_held_out_split_is_seeded_and_disjoint_from_training(tmp_path: Path) -> None:
    path = write(tmp_path, "jsonl")
    data = load_dataset_task(task(path, eval_fraction=0.3, eval_size=2), ALL)
    trained = {data.source.prompt_at(i).text for i in range(30)}
    held = [p.text for p in load_dataset_task(task(path, eval_fraction=0.3), ALL).eval_prompts]
    assert len(trained) == 7 and len(held) == 3
    assert not trained & set(held)
    assert [p.text for p in data.eval_prompts] == held[:2]  # task.eval_size caps them
    assert [p.prompt_id for p in data.eval_prompts] == ["train-eval-0", "train-eval-1"]
    other = load_dataset_task(task(path, eval_fraction=0.3, seed=1), ALL).eval_prompts
    assert {p.text for p in other} != set(held)


def test_eval_path_or_the_first_training_rows_are_the_eval_prompts(tmp_path: Path) -> None:
    train = write(tmp_path, "csv")
    held = write(tmp_path, "jsonl", [{**r, "question": "held " + r["question"]}
                                     for r in ROWS[:4]], name="held")
    data = load_dataset_task(task(train, eval_path=str(held), eval_size=3), ALL)
    assert [p.text for p in data.eval_prompts] == [f"held {i}+1=" for i in range(3)]
    assert len(data.source) == 10
    plain = load_dataset_task(task(train, eval_size=2), ALL)
    assert [p.text for p in plain.eval_prompts] == ["0+1=", "1+1="]


def test_prompts_too_long_for_the_context_are_refused_with_a_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    rows = [{"question": "x" * n, "solution": "1"} for n in (4, 30, 5, 40, 6)]
    path = write(tmp_path, "jsonl", rows)
    model = tokenizer_dir(tmp_path)  # context 64
    config = task(path, chat_template=True, eval_size=5)
    fits = model_fit(str(model), config, max_new_tokens=20)
    assert fits.context == 64
    data = load_dataset_task(config, fits)
    # "<|user|>" + text + "\n<|assistant|>": 22 tokens of template; 30 + 22 + 20 > 64.
    assert len(data.source) == 3 and data.source.refused_too_long == 2
    assert all(len(data.source.prompt_at(i).text) <= 6 for i in range(9))
    assert len(data.eval_prompts) == 3  # the first training rows that fit
    assert "2 prompt(s)" in caplog.text
    held = load_dataset_task(msgspec.structs.replace(config, eval_fraction=0.4), fits)
    assert held.source.refused_too_long == 2  # held-out rows count too
    assert len(held.source) + len(held.eval_prompts) == 3
    with pytest.raises(ConfigError, match=r"task\.path = .*no prompt fits"):
        load_dataset_task(config, model_fit(str(model), config, max_new_tokens=60))


def test_render_gives_the_chat_templates_token_ids_with_the_system_prompt() -> None:
    tokenizer = build_tokenizer()
    prompt = Prompt(prompt_id="p", text="3+4=", answer="7")
    fmt = PromptFormat(chat_template=True, system_prompt="Be brief.")
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4="}],
        add_generation_prompt=True, return_dict=False)
    assert render(tokenizer, prompt, fmt) == list(expected)
    assert prompt_tokens(tokenizer, prompt, fmt) == len(expected)
    assert render(tokenizer, prompt, PromptFormat()) == "3+4="
    own = Prompt(prompt_id="q", text="hi", answer="", messages=(
        {"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}))
    assert conversation(own, "Be brief.")[0]["content"] == "Mine."  # its own wins


SCORING = '''
def trl(prompts, completions, answer, level, **kwargs):
    ok = (prompts[0][0] == {"role": "system", "content": "S"}
          and prompts[0][1] == {"role": "user", "content": "6*7="}
          and completions[0] == [{"role": "assistant", "content": "42"}]
          and answer == ["42", "42"] and level == [3, 3])
    return [1.0 if ok else 0.0] * len(completions)


def verl(data_source, solution_str, ground_truth, extra_info=None):
    ok = (data_source == "gsm" and ground_truth == "42" and solution_str == "42"
          and extra_info == {"answer": "42", "level": 3})
    return 2.0 if ok else 0.0
'''


def test_scorer_hands_rewards_the_rows_columns_data_source_and_messages(
    tmp_path: Path,
) -> None:
    rewards = tmp_path / "scoring.py"
    rewards.write_text(SCORING)
    user = UserRewards(specs=(RewardSpec(function=f"{rewards}:trl"),
                              RewardSpec(function=f"{rewards}:verl")),
                       threads=True, chat=True, columns=("answer", "level"),
                       eval_reward="verl")
    scorer = Scorer(lambda p, c: 0.0, user, PromptFormat(chat_template=True,
                                                         system_prompt="S"))
    scorer.start()
    try:
        prompt = Prompt(prompt_id="p", text="6*7=", answer="42", columns={"level": 3},
                        data_source="gsm")
        sample = Sample(token_ids=(1,), logprobs=(0.0,), versions=(0,),
                        finish_reason="stop", text="42")
        scored = asyncio.run(scorer.score(prompt, [sample, sample]))
        assert [s.reward for s in scored.samples] == [3.0, 3.0]
        assert scored.scores == {"trl": (1.0, 1.0), "verl": (2.0, 2.0)}
        assert scored.errors == 0
        # An evaluation's accuracy is task.eval_reward's value, not the weighted sum.
        assert asyncio.run(scorer.score_greedy(prompt, sample)).reward == 2.0
    finally:
        scorer.close()


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(("kw", "key", "why"), [
    (dict(kind="dataset"), "task.path", "required"),
    (dict(path="x.csv"), "task.path", 'only for task.kind = "dataset"'),
    (dict(kind="dataset", path="x.csv", eval_path="y.csv", eval_fraction=0.1),
     "task.eval_fraction", "not both"),
    (dict(system_prompt="S"), "task.system_prompt", "chat_template"),
    (dict(eval_reward="r"), "task.eval_reward", "none"),
    (dict(kind="dataset", path="x.csv", answer_key=""), "task.answer_key", "task.rewards"),
])
def test_task_config_rules_name_the_key(kw: dict[str, Any], key: str, why: str) -> None:
    with pytest.raises(ValueError, match=rf"{key} = .*{why}"):
        task_config(**kw)


@pytest.mark.parametrize("fraction", [-0.1, 1.0])
def test_eval_fraction_must_be_in_0_1(fraction: float) -> None:
    with pytest.raises(ConfigError, match=r"task\.eval_fraction"):
        decode_config({"model": {"path": "m"}, "task": {
            "kind": "dataset", "path": "x.csv", "eval_fraction": fraction}})


def config_of(model: Path, **task_keys: Any) -> Config:
    return decode_config({"model": {"path": str(model)},
                          "task": {"kind": "dataset", **task_keys}})


def bad(tmp_path: Path) -> dict[str, tuple[dict[str, Any], str, str]]:
    """Each bad input: its task keys, the key its line names, and what the line says."""
    good = str(write(tmp_path, "parquet"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet at all")
    (tmp_path / "data.txt").write_text("hello\n")
    return {
        "missing file": ({"path": str(tmp_path / "nope.jsonl")}, "task.path", "no such file"),
        "unsupported": ({"path": str(tmp_path / "data.txt")}, "task.path", "unsupported"),
        "unreadable": ({"path": str(corrupt)}, "task.path", "cannot read it as .parquet"),
        "not a saved dir": ({"path": str(tmp_path)}, "task.path", "save_to_disk"),
        "empty": ({"path": str(empty)}, "task.path", "empty"),
        "prompt_key": ({"path": good, "prompt_key": "prompt"}, "task.prompt_key",
                       "its columns: question, solution, level, data_source"),
        "answer_key": ({"path": good, "prompt_key": "question"}, "task.answer_key",
                       "its columns: question, solution, level, data_source"),
        "eval_path": ({"path": good, "prompt_key": "question", "answer_key": "solution",
                       "eval_path": str(tmp_path / "none.csv")}, "task.eval_path",
                      "no such file"),
        "eval columns": ({"path": good, "prompt_key": "question", "answer_key": "solution",
                          "eval_path": str(write(tmp_path, "csv", [{"q": "1", "a": "2"}],
                                                 name="held"))},
                         "task.prompt_key", "in task.eval_path"),
        "all held out": ({"path": good, "prompt_key": "question", "answer_key": "solution",
                          "eval_fraction": 0.99}, "task.eval_fraction", "none left to train"),
        "not text": ({"path": str(write(tmp_path, "jsonl", [{"prompt": 5, "answer": 1}],
                                        name="ints"))}, "task.prompt_key", "row 0"),
    }


CASES = ["missing file", "unsupported", "unreadable", "not a saved dir", "empty",
         "prompt_key", "answer_key", "eval_path", "eval columns", "all held out", "not text"]


@pytest.mark.parametrize("case", CASES)
def test_bad_datasets_fail_check_inputs_in_one_line_naming_the_key(
    tmp_path: Path, case: str,
) -> None:
    keys, key, says = bad(tmp_path)[case]
    with pytest.raises(ConfigError) as err:
        check_inputs(config_of(tokenizer_dir(tmp_path), **keys))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"config error: {key} = "), line
    assert says in line


def test_a_chat_template_on_a_tokenizer_without_one_is_a_config_error(tmp_path: Path) -> None:
    path = str(write(tmp_path, "parquet"))
    keys = {"path": path, "prompt_key": "question", "answer_key": "solution",
            "chat_template": True}
    check_inputs(config_of(tokenizer_dir(tmp_path), **keys))  # the tiny tokenizer has one
    with pytest.raises(ConfigError, match=r"^config error: task\.chat_template = true: .*"
                                          r"no chat template"):
        check_inputs(config_of(tokenizer_dir(tmp_path, chat=False), **keys))


def test_rewards_are_checked_on_the_datasets_columns_and_eval_reward_named(
    tmp_path: Path,
) -> None:
    rewards = tmp_path / "r.py"
    rewards.write_text("def by_level(completions, level, **kw):\n"
                       "    return [float(x) for x in level]\n"
                       "def needs_grade(completions, grade):\n    return [0.0]\n")
    keys = {"path": str(write(tmp_path, "parquet")), "prompt_key": "question",
            "answer_key": "solution"}
    model = tokenizer_dir(tmp_path)
    spec = {"function": f"{rewards}:by_level"}
    check_inputs(config_of(model, **keys, rewards=[spec], eval_reward="by_level"))
    with pytest.raises(ConfigError, match=r"^config error: task\.eval_reward = 'nope': "
                                          r"not one of task\.rewards \(their names: by_level"):
        check_inputs(config_of(model, **keys, rewards=[spec], eval_reward="nope"))
    with pytest.raises(ConfigError, match=r"task\.rewards\[0\].*grade"):
        check_inputs(config_of(model, **keys, rewards=[{"function": f"{rewards}:needs_grade"}]))


def test_train_with_a_missing_column_exits_2_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    model = tokenizer_dir(tmp_path)
    data = write(tmp_path, "csv")
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\npath = "{model}"\n[run]\noutput_dir = "{tmp_path}/r"\n'
                      f'[task]\nkind = "dataset"\npath = "{data}"\nprompt_key = "q"\n')
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: task.prompt_key = 'q'")
    assert not (tmp_path / "r").exists()
