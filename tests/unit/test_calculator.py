"""The calculator tool task: the safe expression evaluator, the prompt stream and its
held-out split, the environment's reset/step and scoring, the seeded tool latency, the
warm start's teacher traces (and their untrained tool results), and the greedy
multi-turn evaluation with a scripted policy. Pure Python; no model, no engine.
"""

from __future__ import annotations

import random
import statistics
import time

import anyio
import pytest

from async_rl.config_io import decode_config
from async_rl.models import tool_eval
from async_rl.models.tiny_model import build_tokenizer
from async_rl.models.tool_eval import cut_at_stop, evaluate_with_environment
from async_rl.models.warm_start import IGNORE, _example
from async_rl.tasks.calculator import (
    CALL_CLOSE,
    MAX_MAGNITUDE,
    TOOL_LATENCY_SIGMA,
    CalculatorEnv,
    CalculatorTask,
    ExpressionError,
    ToolLatency,
    calculator_reward,
    environment_factory,
    evaluate_expression,
    final_answer,
)
from async_rl.tasks.rewards import EOS_TEXT
from buffers.common.records import Prompt
from workers.rollout.environment import EnvStep


@pytest.mark.parametrize(("text", "value"), [
    ("2+3", 5), ("47*83+512-96", 4317), ("10-20*3", -50), ("(1+2)*3", 9), ("-4*-5", 20),
    (" 7 * 6 ", 42), ("0", 0), ("((12))", 12),
])
def test_expressions_evaluate_with_precedence(text: str, value: int) -> None:
    assert evaluate_expression(text) == value


@pytest.mark.parametrize("text", [
    "", "2/3", "2**8", "__import__('os')", "1.5+2", "1_000+1", "2+", "(1", "x+1", "1e3",
    "9" * 13, "999999*999999*999999", "(" * 150 + "1" + ")" * 150, "True+1",
])
def test_anything_else_is_an_expression_error(text: str) -> None:
    with pytest.raises(ExpressionError):
        evaluate_expression(text)


def test_magnitude_bound_holds_for_intermediate_values() -> None:
    assert evaluate_expression("999999*999999") < MAX_MAGNITUDE
    with pytest.raises(ExpressionError, match="beyond"):
        evaluate_expression("9999999*9999999-9999999*9999999")


def test_prompts_are_deterministic_two_to_four_terms_and_answered_right() -> None:
    task = CalculatorTask(seed=3)
    prompts = [task.next_prompt() for _ in range(500)]
    assert [p.prompt_id for p in prompts[:2]] == ["calc-0", "calc-1"]
    assert prompts == [CalculatorTask(seed=3).prompt_at(i) for i in range(500)]
    assert prompts != [CalculatorTask(seed=4).prompt_at(i) for i in range(500)]
    terms = [len(p.text.replace("*", "+").replace("-", "+").split("+")) for p in prompts]
    assert set(terms) == {2, 3, 4}
    for prompt in prompts:
        assert prompt.text.endswith("=")
        assert prompt.answer == str(evaluate_expression(prompt.text[:-1]))
        for product in prompt.text[:-1].replace("-", "+").split("+"):
            if "*" in product:  # two-digit factors: answers a tool needs, not a giant one
                assert all(10 <= int(f) <= 99 for f in product.split("*"))


def test_held_out_expressions_never_train() -> None:
    task = CalculatorTask()
    evals = task.eval_prompts(300)
    assert len(evals) == 300 and evals == CalculatorTask(seed=9).eval_prompts(300)
    assert evals[0].prompt_id == "calc-eval-0"
    assert all(task.is_held_out(p.text[:-1]) for p in evals)
    train = {task.prompt_at(i).text for i in range(3000)}
    assert not train & {p.text for p in evals}


def test_final_answer_and_reward_read_what_follows_the_last_result() -> None:
    prompt = Prompt(prompt_id="calc-0", text="47*83+512-96=", answer="4317")
    assert final_answer("#### 4317") == "4317"
    assert final_answer(f"#### -44{EOS_TEXT}") == "-44"
    trajectory = "<call>47*83+512-96</call><result>4317</result>#### 4317"
    assert calculator_reward(prompt, trajectory) == 1.0
    assert calculator_reward(prompt, "#### 4317") == 1.0
    for wrong in ("#### 4318", "4317", "#### 4317 ", "#### 04317", "<call>47*83+512-96</call>",
                  "<result>4317</result>", "<result>4317</result>#### 4317x"):
        assert calculator_reward(prompt, wrong) == 0.0, wrong


def test_environment_calls_the_tool_then_scores_the_answer() -> None:
    async def trajectory() -> tuple[str, list[EnvStep], int]:
        env = CalculatorEnv()
        first = await env.reset({"prompt": "47*83+512-96=", "answer": "4317", "x": 1})
        steps = [await env.step("let me see <call>47*83+512-96</call>"),
                 await env.step(f"#### 4317{EOS_TEXT}")]
        return first, steps, env.calls

    first, (call, answer), calls = anyio.run(trajectory)
    assert first == "47*83+512-96="
    assert call == EnvStep(observation="<result>4317</result>", reward=0.0, done=False)
    assert answer == EnvStep(observation=None, reward=1.0, done=True)
    assert calls == 1


@pytest.mark.parametrize(("turn", "observation"), [
    ("<call>2/0</call>", "<result>error</result>"),
    ("no opening tag</call>", "<result>error</result>"),
    ("<call>1+1</call><call>5*5</call>", "<result>25</result>"),
])
def test_bad_calls_get_an_error_result_and_the_trajectory_goes_on(
        turn: str, observation: str) -> None:
    async def one_step() -> EnvStep:
        env = CalculatorEnv()
        await env.reset({"prompt": "1+1=", "answer": 2})
        return await env.step(turn)

    assert anyio.run(one_step) == EnvStep(observation=observation, reward=0.0, done=False)


@pytest.mark.parametrize("final", ["#### 3", "2", "<call>1+1", ""])
def test_a_wrong_or_unfinished_answer_ends_with_zero(final: str) -> None:
    async def one_step() -> EnvStep:
        env = CalculatorEnv()
        await env.reset({"prompt": "1+1=", "answer": 2})
        return await env.step(final)

    assert anyio.run(one_step) == EnvStep(observation=None, reward=0.0, done=True)


def test_latency_draws_are_seeded_log_normal_with_the_median() -> None:
    draws = [ToolLatency(50.0, seed=1).draw_s() for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]  # a fresh stream starts at the same draw
    stream = ToolLatency(50.0, seed=1)
    sample = [stream.draw_s() for _ in range(20_000)]
    assert len(set(sample)) == len(sample)
    assert statistics.median(sample) == pytest.approx(0.050, rel=0.05)
    p99 = sorted(sample)[int(0.99 * len(sample))]
    assert p99 / 0.050 == pytest.approx(10.2, rel=0.15)  # exp(2.33 sigma): the heavy tail
    assert TOOL_LATENCY_SIGMA == 1.0
    other = ToolLatency(50.0, seed=2)
    assert [other.draw_s() for _ in range(5)] != sample[:5]
    assert ToolLatency(0.0).draw_s() == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        ToolLatency(-1.0)


def test_environment_sleeps_the_drawn_latency_and_factory_shares_one_stream() -> None:
    make = environment_factory(tool_latency_ms=40.0, seed=0)
    expected = ToolLatency(40.0, seed=0)
    first, second = expected.draw_s(), expected.draw_s()

    async def two_calls() -> list[float]:
        took = []
        for env in (make(), make()):
            await env.reset({"prompt": "1+1=", "answer": "2"})
            start = time.perf_counter()
            await env.step("<call>1+1</call>")
            took.append(time.perf_counter() - start)
        return took

    took = anyio.run(two_calls)
    assert len(took) == 2
    for seconds, drawn in zip(took, (first, second), strict=True):
        assert drawn <= seconds < drawn + 0.5  # a loaded machine wakes late, never early


def test_config_takes_the_calculator_and_its_latency() -> None:
    config = decode_config({"model": {"path": "m"},
                            "task": {"kind": "calculator", "tool_latency_ms": 200.0}})
    assert (config.task.kind, config.task.tool_latency_ms) == ("calculator", 200.0)


def test_teacher_calls_on_two_terms_and_sometimes_on_more() -> None:
    task = CalculatorTask()
    rng = random.Random(0)
    prompts = [task.prompt_at(i) for i in range(2000)]
    traces = [(p, task.teacher_completion(p, rng, 0.3)) for p in prompts]
    assert len(traces) == 2000
    long_calls = []
    for prompt, segments in traces:
        expression, value = prompt.text[:-1], prompt.answer
        if segments[0][0].startswith("<call>"):
            assert segments == ((f"<call>{expression}</call>", True),
                                (f"<result>{value}</result>", False), (f"#### {value}", True))
        else:  # in its head, wrongly
            ((text, trained),) = segments
            assert trained and text.startswith("#### ") and text != f"#### {value}"
            assert final_answer(text) is not None
        if len(expression.replace("*", "+").replace("-", "+").split("+")) == 2:
            assert len(segments) == 3
        else:
            long_calls.append(len(segments) == 3)
    assert len(long_calls) > 1000
    assert sum(long_calls) / len(long_calls) == pytest.approx(0.3, abs=0.04)


def test_warm_start_examples_do_not_train_on_the_tool_result() -> None:
    tokenizer = build_tokenizer()
    prompt = Prompt(prompt_id="calc-0", text="12*34=", answer="408")
    segments = (("<call>12*34</call>", True), ("<result>408</result>", False),
                ("#### 408", True))
    ids, labels = _example(tokenizer, prompt, segments, eos_id=1)
    whole = "12*34=<call>12*34</call><result>408</result>#### 408"
    assert ids == [*tokenizer.encode(whole), 1]
    assert len(labels) == len(ids)
    trained = tokenizer.decode([t for t, lab in zip(ids, labels, strict=True)
                                if lab != IGNORE and t != 1])
    assert trained == "<call>12*34</call>#### 408"
    assert labels[-1] == 1  # EOS is a target
    # A plain-text completion is all target, as before.
    ids, labels = _example(tokenizer, prompt, "408", eos_id=1)
    assert labels == [IGNORE] * 6 + [*tokenizer.encode("408"), 1]


def test_cut_at_stop_keeps_the_first_stop_string() -> None:
    assert cut_at_stop("<call>1+1</call><result>", ["</call>"]) == "<call>1+1</call>"
    assert cut_at_stop("a</b>c</a>", ["</a>", "</b>"]) == "a</b>"
    assert cut_at_stop("#### 2", ["</call>"]) == "#### 2"


def test_greedy_evaluation_runs_the_tool_between_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def scripted(model: object, tokenizer: object, texts: list[str], *,
                 max_new_tokens: int) -> list[str]:
        # A policy that calls the tool on "+" and answers in its head (wrongly) on "*";
        # past the stop string it rambles on, as greedy decoding without stops does.
        seen.append(list(texts))
        turns = []
        for text in texts:
            if "<result>" in text:
                turns.append("#### " + text.rsplit("<result>", 1)[1].split("<")[0])
            elif "+" in text:
                turns.append(f"<call>{text[:-1]}</call><result>999</result>#### 999")
            else:
                turns.append("#### 1")
        return turns

    monkeypatch.setattr(tool_eval, "greedy_completions", scripted)
    prompts = [Prompt(prompt_id="a", text="512+96=", answer="608"),
               Prompt(prompt_id="b", text="12*34=", answer="408"),
               Prompt(prompt_id="c", text="1+2+3=", answer="6")]
    accuracy = evaluate_with_environment(None, None, prompts, CalculatorEnv,  # type: ignore[arg-type]
                                         stops=(CALL_CLOSE,), max_turns=4, max_new_tokens=32)
    assert accuracy == pytest.approx(2 / 3)
    assert seen == [["512+96=", "12*34=", "1+2+3="],
                    ["512+96=<call>512+96</call><result>608</result>",
                     "1+2+3=<call>1+2+3</call><result>6</result>"]]
