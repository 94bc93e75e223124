"""Prompt sources and rewards: determinism, cursor save/restore, the held-out split, the
arithmetic format check, GSM8K answer extraction and JSONL errors naming file and line.

Pure Python; no model, no engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from async_rl.tasks.rewards import arithmetic_reward, extract_gsm8k_answer, gsm8k_reward
from async_rl.tasks.sources import (
    ArithmeticTask,
    JsonlPromptSource,
    PromptFileError,
    PromptSource,
    SourceMismatchError,
    SourceState,
    read_prompt_file,
)
from buffers.common.records import Prompt

FIXTURE = Path(__file__).parent.parent / "fixtures" / "tiny_gsm.jsonl"


def take(source: PromptSource, n: int) -> list[Prompt]:
    return [source.next_prompt() for _ in range(n)]


def solve(text: str) -> int:
    body = text.removesuffix("=")
    if "+" in body:
        a, b = body.split("+")
        return int(a) + int(b)
    a, b = body.split("-")
    return int(a) - int(b)


# --- arithmetic ------------------------------------------------------------------------


def test_arithmetic_prompts_are_correct_and_in_range() -> None:
    task = ArithmeticTask(seed=3, max_operand=29)
    prompts = take(task, 500)
    assert [p.prompt_id for p in prompts[:3]] == ["arith-0", "arith-1", "arith-2"]
    ops = set()
    for p in prompts:
        assert p.text.endswith("=")
        assert int(p.answer) == solve(p.text) >= 0
        assert all(0 <= int(x) <= 29 for x in p.text[:-1].replace("-", "+").split("+"))
        ops.add("+" if "+" in p.text else "-")
    assert ops == {"+", "-"}
    assert task.max_answer_chars == 2


def test_arithmetic_is_deterministic_per_seed_and_index() -> None:
    first = take(ArithmeticTask(seed=7), 50)
    assert take(ArithmeticTask(seed=7), 50) == first
    assert [ArithmeticTask(seed=7).prompt_at(i) for i in range(50)] == first
    assert [p.text for p in take(ArithmeticTask(seed=8), 50)] != [p.text for p in first]


def test_arithmetic_stream_does_not_depend_on_the_hash_seed() -> None:
    code = (
        "from async_rl.tasks.sources import ArithmeticTask;"
        "t = ArithmeticTask(seed=5);"
        "print([t.prompt_at(i).text for i in range(20)], [p.text for p in t.eval_prompts(5)])"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        ).stdout
        for hash_seed in ("1", "2")
    }
    assert len(outputs) == 1


def test_cursor_save_and_restore_resumes_exactly() -> None:
    task = ArithmeticTask(seed=1)
    take(task, 5)
    saved = task.state()
    assert saved == SourceState(fingerprint=task.fingerprint, next_index=5)
    after = take(task, 4)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(saved), type=SourceState)
    fresh = ArithmeticTask(seed=1)
    fresh.restore(wire)
    assert take(fresh, 4) == after
    assert after[0].prompt_id == "arith-5"
    with pytest.raises(AttributeError):
        saved.next_index = 0  # type: ignore[misc]


def test_restore_refuses_a_state_from_another_source() -> None:
    with pytest.raises(SourceMismatchError, match="seed=1"):
        ArithmeticTask(seed=2).restore(ArithmeticTask(seed=1).state())
    with pytest.raises(SourceMismatchError):
        ArithmeticTask(max_operand=9).restore(ArithmeticTask().state())


def test_eval_set_is_fixed_distinct_and_disjoint_from_training() -> None:
    task = ArithmeticTask(seed=0)
    evals = task.eval_prompts(200)
    assert evals == ArithmeticTask(seed=99).eval_prompts(200)
    assert [p.prompt_id for p in evals[:2]] == ["arith-eval-0", "arith-eval-1"]
    assert len({p.text for p in evals}) == 200
    assert all(int(p.answer) == solve(p.text) for p in evals)
    trained = {p.text for p in take(task, 3000)}
    assert trained.isdisjoint(p.text for p in evals)
    with pytest.raises(ValueError, match="held-out problems exist"):
        task.eval_prompts(10_000)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_operand": 0}, "max_operand"),
        ({"ops": "*"}, "ops"),
        ({"ops": ""}, "ops"),
        ({"held_out_fraction": 0.0}, "held_out_fraction"),
    ],
)
def test_arithmetic_rejects_bad_parameters(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)  # type: ignore[arg-type]


def test_prompt_index_must_be_non_negative() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        ArithmeticTask().prompt_at(-1)


# --- arithmetic reward -----------------------------------------------------------------

NINETEEN = Prompt(prompt_id="arith-0", text="12+7=", answer="19")


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("19", 1.0),
        ("19</s>", 1.0),  # engines that keep special tokens in the text
        ("18", 0.0),  # well-formed, wrong number
        (" 19", 0.0),
        ("19 ", 0.0),
        ("19\n", 0.0),
        ("+19", 0.0),
        ("019", 0.0),
        ("19.0", 0.0),
        ("1 9", 0.0),
        ("19<unk>", 0.0),  # never emitted EOS (greedy_completions marks it so)
        ("19</s></s>", 0.0),
        ("1919", 0.0),
        ("nineteen", 0.0),
        ("", 0.0),
    ],
)
def test_arithmetic_reward_checks_format_and_value(completion: str, reward: float) -> None:
    assert arithmetic_reward(NINETEEN, completion) == reward


def test_arithmetic_reward_handles_zero_and_negative_answers() -> None:
    zero = Prompt(prompt_id="z", text="4-4=", answer="0")
    assert arithmetic_reward(zero, "0") == 1.0
    assert arithmetic_reward(zero, "-0") == 0.0
    negative = Prompt(prompt_id="n", text="2-5=", answer="-3")
    assert arithmetic_reward(negative, "-3") == 1.0
    assert arithmetic_reward(negative, "3") == 0.0


# --- GSM8K-style reward ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 3 + 4 = 7.\n#### 7", "7"),
        ("#### 1,234", "1,234"),
        ("The answer is 42.", "42"),
        ("3 apples and 5 pears", "5"),
        ("#### 7 and later 8", "7"),
        ("it drops to -3", "-3"),
        ("costs 3.50 dollars", "3.50"),
        ("#### 12</s>", "12"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_gsm8k_answer_extraction(text: str, expected: str | None) -> None:
    assert extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize(
    ("answer", "completion", "reward"),
    [
        ("7", "#### 7", 1.0),
        ("3 + 4 = 7\n#### 7", "It is 7.", 1.0),
        ("1234", "#### 1,234", 1.0),
        ("3.5", "half of 7 is 3.50", 1.0),
        ("60", "#### 60.0", 1.0),
        ("7", "#### 8", 0.0),
        ("7", "7 then #### 8", 0.0),
        ("7", "I don't know", 0.0),
        ("no number", "7", 0.0),
    ],
)
def test_gsm8k_reward(answer: str, completion: str, reward: float) -> None:
    prompt = Prompt(prompt_id="g", text="q", answer=answer)
    assert gsm8k_reward(prompt, completion) == reward


# --- JSONL source ----------------------------------------------------------------------


def test_jsonl_source_reads_cycles_and_names_prompts() -> None:
    source = JsonlPromptSource(FIXTURE)
    assert len(source) == 5  # the blank line is skipped
    prompts = take(source, 12)
    assert prompts[0].prompt_id == "tiny_gsm-0"
    assert prompts[11].prompt_id == "tiny_gsm-11"
    assert [p.text for p in prompts[5:10]] == [p.text for p in prompts[:5]]
    assert prompts[1].answer == "60"  # numbers become text
    assert prompts[4].answer == "3.5"
    assert gsm8k_reward(prompts[0], "3 + 4 = 7\n#### 7") == 1.0
    assert gsm8k_reward(prompts[2], "She has 1000 left") == 1.0
    assert gsm8k_reward(prompts[3], "#### -3") == 1.0


def test_jsonl_cursor_save_and_restore() -> None:
    source = JsonlPromptSource(FIXTURE, shuffle=True, seed=4)
    take(source, 7)
    saved = source.state()
    after = take(source, 6)
    fresh = JsonlPromptSource(FIXTURE, shuffle=True, seed=4)
    fresh.restore(saved)
    assert take(fresh, 6) == after
    with pytest.raises(SourceMismatchError):
        JsonlPromptSource(FIXTURE, shuffle=True, seed=5).restore(saved)
    with pytest.raises(SourceMismatchError):
        ArithmeticTask().restore(saved)


def test_jsonl_shuffle_permutes_each_pass() -> None:
    source = JsonlPromptSource(FIXTURE, shuffle=True, seed=0)
    passes = [[p.text for p in take(source, 5)] for _ in range(4)]
    in_order = [text for text, _ in read_prompt_file(FIXTURE)]
    assert all(sorted(p) == sorted(in_order) for p in passes)
    assert any(p != in_order for p in passes)
    assert source.prompt_at(3) == JsonlPromptSource(FIXTURE, shuffle=True, seed=0).prompt_at(3)


@pytest.mark.parametrize(
    ("lines", "line_number", "match"),
    [
        (['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": '], 2, "invalid JSON"),
        (['{"prompt": "a", "answer": 1}', "", '{"prompt": "c"}'], 3, "answer"),
        (['{"prompt": 5, "answer": 1}'], 1, "prompt"),
        (['["a", 1]'], 1, "got `array`"),
        (['{"prompt": "a", "answer": null}'], 1, "answer"),
    ],
)
def test_malformed_jsonl_line_names_file_and_line(
    tmp_path: Path, lines: list[str], line_number: int, match: str
) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PromptFileError, match=match) as info:
        JsonlPromptSource(path)
    assert info.value.path == path
    assert info.value.line == line_number
    assert str(info.value).startswith(f"{path}:{line_number}: ")


def test_empty_or_missing_prompt_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(PromptFileError, match="no prompts") as info:
        read_prompt_file(empty)
    assert info.value.line is None
    with pytest.raises(PromptFileError, match="cannot read"):
        read_prompt_file(tmp_path / "missing.jsonl")
