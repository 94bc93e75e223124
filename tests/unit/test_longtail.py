"""The long-tail (remainder) task: its heavy-tailed length law, determinism, cursor
save/restore, the held-out split, the reward's format check and the warm-start teacher.

Pure Python; no model, no engine.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import msgspec
import pytest

from async_rl.tasks.longtail import (
    MAX_DIVISOR,
    MAX_NEW_TOKENS,
    MAX_NUMBER,
    RemainderTask,
    parse_prompt,
    reference_completion,
    reference_steps,
)
from async_rl.tasks.rewards import EOS_TEXT, arithmetic_reward, remainder_reward
from async_rl.tasks.sources import ArithmeticTask, SourceMismatchError, SourceState
from buffers.common.records import Prompt

TRAIN_PROMPTS = 20_000
"""Enough that the 99th percentile of the lengths is stable (at 5000 it still moves by
10%); half a second."""


def take(task: RemainderTask, n: int) -> list[Prompt]:
    return [task.next_prompt() for _ in range(n)]


def reference(prompt: Prompt) -> str:
    return reference_completion(*parse_prompt(prompt.text))


def completion_tokens(prompt: Prompt) -> int:
    """Tokens of the reference completion as the byte-level tokenizer counts them: one per
    (ASCII) character, plus EOS."""
    return len(reference(prompt).encode()) + 1


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@pytest.fixture(scope="module")
def train_prompts() -> list[Prompt]:
    return take(RemainderTask(seed=0), TRAIN_PROMPTS)


# --- the prompt stream -------------------------------------------------------------------


def test_reference_trace_by_example() -> None:
    # The module docstring's example.
    assert reference_steps(47, 9) == ["47-9=38", "38-9=29", "29-9=20", "20-9=11", "11-9=2"]
    assert reference_completion(47, 9) == "47-9=38 38-9=29 29-9=20 20-9=11 11-9=2 #### 2"
    assert reference_completion(47, 9, final_answer=3).endswith("11-9=2 #### 3")
    assert reference_completion(9, 9) == "9-9=0 #### 0"  # remainder zero: the last step is 0
    assert reference_completion(10, 9) == "10-9=1 #### 1"
    assert parse_prompt("47%9=") == (47, 9)


def test_prompts_are_well_formed(train_prompts: list[Prompt]) -> None:
    assert [p.prompt_id for p in train_prompts[:3]] == ["longtail-0", "longtail-1", "longtail-2"]
    divisors = set()
    for p in train_prompts:
        assert p.text == f"{p.text[:-1]}=" and p.text.count("%") == 1
        number, divisor = parse_prompt(p.text)
        assert p.text == f"{number}%{divisor}="  # canonical integers, nothing else
        assert 2 <= divisor <= MAX_DIVISOR
        steps, remainder = divmod(number, divisor)
        assert number == divisor * steps + remainder and steps >= 1
        assert divisor <= number <= MAX_NUMBER
        assert p.answer == str(number % divisor)
        trace = [step.replace("=", "-").split("-") for step in reference_steps(number,
                                                                              divisor)]
        assert len(trace) == steps
        assert [int(a) for a, _, _ in trace] == list(range(number, remainder, -divisor))
        assert all(int(k) == divisor and int(a) - divisor == int(b) for a, k, b in trace)
        assert int(trace[-1][2]) == remainder
        divisors.add(divisor)
    assert divisors == set(range(2, MAX_DIVISOR + 1))


def test_completion_lengths_have_a_heavy_tail(train_prompts: list[Prompt]) -> None:
    lengths = sorted(completion_tokens(p) for p in train_prompts)
    p50, p99 = percentile(lengths, 0.5), percentile(lengths, 0.99)
    assert 16 <= p50 <= 32, p50
    assert p99 >= 8 * p50, (p50, p99)
    longer = sum(n > MAX_NEW_TOKENS for n in lengths)
    assert 0 < longer < 0.02 * len(lengths), longer  # a few, not many
    assert lengths[0] == len(reference_completion(2, 2)) + 1  # one step is the shortest


def test_default_eval_set_spans_short_and_long_traces(train_prompts: list[Prompt]) -> None:
    # Not the training law exactly: the problems are distinct and short traces have few
    # distinct held-out problems, so the eval set leans long. It still covers both ends.
    train_p50 = percentile(sorted(completion_tokens(p) for p in train_prompts), 0.5)
    lengths = sorted(completion_tokens(p) for p in RemainderTask().eval_prompts(200))
    assert lengths[0] <= train_p50 and lengths[-1] > MAX_NEW_TOKENS // 2, lengths


def test_stream_is_deterministic_per_seed_and_index(train_prompts: list[Prompt]) -> None:
    first = train_prompts[:200]
    assert take(RemainderTask(seed=0), 200) == first
    assert [RemainderTask(seed=0).prompt_at(i) for i in (199, 3, 0)] == [first[199], first[3],
                                                                        first[0]]
    other = take(RemainderTask(seed=1), 200)
    assert [p.prompt_id for p in other] == [p.prompt_id for p in first]
    assert sum(a.text != b.text for a, b in zip(first, other, strict=True)) > 150
    renamed = RemainderTask(name="rem").prompt_at(0)
    assert renamed.prompt_id == "rem-0"


def test_stream_does_not_depend_on_the_hash_seed() -> None:
    code = (
        "from async_rl.tasks.longtail import RemainderTask;"
        "t = RemainderTask(seed=5);"
        "print([t.prompt_at(i).text for i in range(20)], [p.text for p in t.eval_prompts(5)])"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        ).stdout
        for hash_seed in ("1", "2")
    }
    assert len(outputs) == 1


def test_cursor_save_and_restore_resumes_exactly() -> None:
    task = RemainderTask(seed=4)
    take(task, 7)
    saved = task.state()
    assert saved == SourceState(fingerprint=task.fingerprint, next_index=7)
    after = take(task, 5)
    assert after[0].prompt_id == "longtail-7"
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(saved), type=SourceState)
    fresh = RemainderTask(seed=4)
    fresh.restore(wire)
    assert take(fresh, 5) == after
    assert fresh.state().next_index == 12


@pytest.mark.parametrize(
    "other",
    [
        {"seed": 1},
        {"median_steps": 6.0},
        {"sigma": 0.5},
        {"max_steps": 40},
        {"held_out_fraction": 0.1},
        {"name": "rem"},
    ],
)
def test_restore_refuses_a_state_from_another_source(other: dict[str, object]) -> None:
    saved = RemainderTask().state()
    with pytest.raises(SourceMismatchError, match="longtail:"):
        RemainderTask(**other).restore(saved)  # type: ignore[arg-type]


def test_restore_refuses_states_across_task_kinds() -> None:
    with pytest.raises(SourceMismatchError):
        RemainderTask().restore(ArithmeticTask().state())
    with pytest.raises(SourceMismatchError):
        ArithmeticTask().restore(RemainderTask().state())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"median_steps": 0.5}, "median_steps"),
        ({"median_steps": 100.0}, "median_steps"),
        ({"max_steps": 0, "median_steps": 1.0}, "max_steps"),
        ({"max_steps": MAX_NUMBER // 2 + 1}, "max_steps"),
        ({"sigma": -0.1}, "sigma"),
        ({"held_out_fraction": 0.0}, "held_out_fraction"),
        ({"held_out_fraction": 0.5}, "held_out_fraction"),
    ],
)
def test_rejects_bad_parameters(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RemainderTask(**kwargs)  # type: ignore[arg-type]


def test_prompt_index_must_be_non_negative() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        RemainderTask().prompt_at(-1)


def test_sigma_zero_gives_the_median_trace_length_only() -> None:
    task = RemainderTask(median_steps=3.0, sigma=0.0)
    assert {parse_prompt(p.text)[0] // parse_prompt(p.text)[1] for p in take(task, 100)} == {3}


# --- the held-out split ------------------------------------------------------------------


def test_no_training_prompt_is_held_out(train_prompts: list[Prompt]) -> None:
    task = RemainderTask(seed=0)
    assert not any(task.is_held_out(*parse_prompt(p.text)) for p in train_prompts)
    # The split is a real slice of the problem space, not an empty one.
    problems = [(n, k) for k in range(2, MAX_DIVISOR + 1) for n in range(k, MAX_NUMBER + 1)]
    held = sum(task.is_held_out(*problem) for problem in problems) / len(problems)
    assert 0.15 < held < 0.25


def test_eval_set_is_held_out_fixed_and_seed_independent(
    train_prompts: list[Prompt],
) -> None:
    task = RemainderTask(seed=0)
    evals = task.eval_prompts(200)
    assert len(evals) == 200
    assert [p.prompt_id for p in evals[:2]] == ["longtail-eval-0", "longtail-eval-1"]
    assert all(task.is_held_out(*parse_prompt(p.text)) for p in evals)
    # Drawn with repeats from the training length law (see eval_prompts): many distinct
    # problems all the same, and the same median length as training.
    assert len({p.text for p in evals}) >= 100
    eval_lengths = sorted(len(reference_completion(*parse_prompt(p.text))) for p in evals)
    train_lengths = sorted(len(reference_completion(*parse_prompt(p.text)))
                           for p in train_prompts)
    assert abs(eval_lengths[100] - train_lengths[len(train_lengths) // 2]) <= 6
    assert all(p.answer == str(parse_prompt(p.text)[0] % parse_prompt(p.text)[1])
               for p in evals)
    assert evals == RemainderTask(seed=99).eval_prompts(200)  # independent of seed
    take(task, 10)
    assert task.eval_prompts(200) == evals  # and of the cursor
    assert task.eval_prompts(50) == evals[:50]  # a fixed order: a smaller set is a prefix
    assert {p.text for p in train_prompts}.isdisjoint(p.text for p in evals)
    assert task.eval_prompts(0) == () == task.eval_prompts(-3)


# --- the reward --------------------------------------------------------------------------

FORTY_SEVEN = Prompt(prompt_id="longtail-0", text="47%9=", answer="2")
TRACE = reference_completion(47, 9).removesuffix(" #### 2")
"""``47-9=38 38-9=29 29-9=20 20-9=11 11-9=2``: the steps of the module's example."""


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        (f"{TRACE} #### 2", 1.0),
        (f"{TRACE} #### 2{EOS_TEXT}", 1.0),  # engines that keep special tokens in the text
        (f"{TRACE} #### 3", 0.0),  # well formed, wrong final answer
        (f"{TRACE} 2", 0.0),  # no "####"
        (f"{TRACE} ####", 0.0),
        (f"{TRACE} #### ", 0.0),
        (f"{TRACE} #### 02", 0.0),  # non-canonical integers
        (f"{TRACE} #### +2", 0.0),
        (f"{TRACE} #### 2.0", 0.0),
        (f"{TRACE} #### 2 ", 0.0),  # anything after the answer
        (f"{TRACE} #### 2\n", 0.0),
        (f"{TRACE} #### 2 #### 2", 0.0),
        (f"{TRACE} #### 2 done", 0.0),
        (f"{TRACE} #### 2{EOS_TEXT}{EOS_TEXT}", 0.0),
        (f"{TRACE} #### 2<unk>", 0.0),  # never emitted EOS (greedy_completions marks it so)
        (f"{TRACE} ####2", 0.0),  # exactly one space either side of "####"
        (f"{TRACE}  #### 2", 0.0),
        (TRACE.replace(" ", "  ", 1) + " #### 2", 0.0),  # steps separated by single spaces
        (f" {TRACE} #### 2", 0.0),
        (TRACE.replace(" ", ",") + " #### 2", 0.0),
        ("38 29 20 11 2 #### 2", 0.0),  # bare numbers are not steps
        ("47-9=38 38-9 29-9=20 #### 2", 0.0),  # a step without its result
        ("47-9=38 38-9=29 29-9=20 20-9=1", 0.0),  # cut off at the token limit: no "####"
        (f"{TRACE} ##", 0.0),
        ("", 0.0),
        (EOS_TEXT, 0.0),
        # The steps' arithmetic is not checked (documented): a wrong step with the right
        # answer, and a completion with no steps at all, are well formed.
        (TRACE.replace("29-9=20", "29-9=21"), 0.0),  # ...though still needs "####"
        (TRACE.replace("29-9=20", "29-9=21") + " #### 2", 1.0),
        ("47-9=38 38-9=-7 #### 2", 1.0),
        ("#### 2", 1.0),
        ("#### 3", 0.0),
    ],
)
def test_remainder_reward_checks_format_and_value(completion: str, reward: float) -> None:
    assert remainder_reward(FORTY_SEVEN, completion) == reward


def test_remainder_reward_of_a_zero_remainder() -> None:
    zero = Prompt(prompt_id="z", text="27%9=", answer="0")
    trace = reference_completion(27, 9).removesuffix(" #### 0")
    assert trace == "27-9=18 18-9=9 9-9=0"
    assert remainder_reward(zero, f"{trace} #### 0") == 1.0
    assert remainder_reward(zero, f"{trace} #### -0") == 0.0
    assert remainder_reward(zero, f"{trace} #### 00") == 0.0
    assert remainder_reward(zero, f"{trace} #### 9") == 0.0


def test_every_reference_completion_scores_one(train_prompts: list[Prompt]) -> None:
    for p in [*train_prompts[:1000], *RemainderTask().eval_prompts(200)]:
        assert remainder_reward(p, reference(p)) == 1.0, p
        assert remainder_reward(p, reference(p) + EOS_TEXT) == 1.0, p
        number, divisor = parse_prompt(p.text)
        wrong = reference_completion(number, divisor, number % divisor + 1)
        assert remainder_reward(p, wrong) == 0.0, p
        cut = reference(p)[: MAX_NEW_TOKENS // 8]  # a prefix that stops before "####"
        if "####" not in cut:
            assert remainder_reward(p, cut) == 0.0, p


# --- the warm-start teacher ---------------------------------------------------------------


def test_remainder_teacher_is_right_with_accuracy_one_and_one_too_high_with_zero(
    train_prompts: list[Prompt],
) -> None:
    task = RemainderTask()
    rng = random.Random(0)
    for p in train_prompts[:300]:
        assert task.teacher_completion(p, rng, 1.0) == reference(p)
        wrong = task.teacher_completion(p, rng, 0.0)
        trace, _, answer = wrong.partition(" #### ")
        assert f"{trace} #### {p.answer}" == reference(p)  # the trace itself is right
        assert answer == str(int(p.answer) + 1)
        assert remainder_reward(p, wrong) == 0.0


def test_remainder_teacher_accuracy_is_the_share_of_right_answers(
    train_prompts: list[Prompt],
) -> None:
    task = RemainderTask()
    rng = random.Random("teacher/0")
    right = [remainder_reward(p, task.teacher_completion(p, rng, 0.3)) for p in train_prompts]
    assert 0.27 < sum(right) / len(right) < 0.33
    # Seeded: the same rng stream gives the same targets.
    first, second = random.Random("teacher/1"), random.Random("teacher/1")
    assert [task.teacher_completion(p, first, 0.3) for p in train_prompts[:100]] == [
        task.teacher_completion(p, second, 0.3) for p in train_prompts[:100]
    ]


def test_arithmetic_teacher_has_the_same_contract() -> None:
    task = ArithmeticTask()
    rng = random.Random(0)
    prompts = [task.next_prompt() for _ in range(300)]
    for p in prompts:
        assert task.teacher_completion(p, rng, 1.0) == p.answer
        wrong = task.teacher_completion(p, rng, 0.0)
        assert wrong == str(int(p.answer) + 1)
        assert arithmetic_reward(p, wrong) == 0.0
    shares = [arithmetic_reward(p, task.teacher_completion(p, rng, 0.3))
              for p in prompts * 10]
    assert 0.26 < sum(shares) / len(shares) < 0.34
