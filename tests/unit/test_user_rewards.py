"""Rewards from user code: loading "file.py:fn" specs, the three calling styles, and the
runner that sums them off the event loop, counting the calls that fail or time out."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from buffers.common.config import ConfigError
from workers.common.user_code import module_name_for
from workers.rewards.calls import (
    RewardShapeError,
    chat_messages,
    is_async_reward,
    score_group,
    score_group_async,
)
from workers.rewards.runner import RewardRunner
from workers.rewards.spec import (
    RewardSpec,
    load_reward,
    reward_style,
    unique_names,
)

REWARDS = '''
import asyncio
import math
import os
import time

def correctness(prompt, completion, answer):
    return float(completion.strip() == answer)

def trl_len(completions, **kwargs):
    return [None if c == "none" else float(len(c)) for c in completions]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    hit = solution_str.strip() == ground_truth
    return {"score": float(hit), "acc": hit, "pred": solution_str, "level": extra_info["level"]}

def boom(prompt, completion):
    raise RuntimeError("reward exploded\\nsecond line")

def sometimes_nan(prompt, completion):
    return math.nan if completion == "nan" else 1.0

def trl_short(completions, **kwargs):
    return [1.0]

def slow(prompt, completion):
    if completion == "slow":
        time.sleep(30)
    return 1.0

def pid(prompt, completion):
    return float(os.getpid())

async def slow_async(prompt, completion):
    if completion == "slow":
        await asyncio.sleep(30)
    return 2.0

async def async_trl(prompts, completions):
    await asyncio.sleep(0)
    return [0.5 for _ in completions]

class Judge:
    def __call__(self, completions, **kwargs):
        return [1.0 for _ in completions]

judge = Judge()
not_a_function = 3

def no_params():
    return 1.0

def secret(prompt, completion, secret_column):
    return 1.0

def one_positional(text):
    return 1.0
'''


@pytest.fixture(scope="module")
def rewards_py(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("user") / "my_rewards.py"
    path.write_text(REWARDS)
    (path.parent / "broken.py").write_text("raise ImportError('no numpy here\\nmore')\n")
    return path


def spec(path: Path, fn: str, **kw: Any) -> RewardSpec:
    return RewardSpec(function=f"{path}:{fn}", **kw)


GROUP: dict[str, Any] = {"prompts": ["2+2=", "2+2="], "completion_ids": [[1, 2], [3]],
                         "columns": {"answer": "4", "level": 3}}


# --- the style of a function, from its parameters --------------------------------------


def test_styles_are_guessed_from_parameters_and_can_be_forced() -> None:
    def trl_any(completions, **kwargs): ...
    def trl_named(prompts, completions, answer): ...
    def verl(data_source, solution_str, ground_truth, extra_info=None): ...
    def gsm8k(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0): ...
    def sample(prompt, completion, answer): ...

    class Judge:
        def __call__(self, completion_ids, **kwargs): ...

    assert reward_style(trl_any) == reward_style(trl_named) == "trl"
    assert reward_style(Judge()) == "trl"
    assert reward_style(verl) == reward_style(gsm8k) == "verl"
    assert reward_style(sample) == "sample"
    assert reward_style(trl_any, "sample") == "sample"
    with pytest.raises(ValueError, match="unknown reward style"):
        reward_style(sample, "openai")


# --- calling one reward on one group ----------------------------------------------------


def test_trl_with_kwargs_gets_every_column_as_lists() -> None:
    seen: dict[str, Any] = {}

    def reward(completions, **kwargs):
        seen.update(kwargs, completions=completions)
        return [1.0, None]

    values = score_group(reward, "trl", completions=["4", "5"], **GROUP)
    assert values.scores == (1.0, None)
    assert seen == {"completions": ["4", "5"], "prompts": ["2+2=", "2+2="],
                    "completion_ids": [[1, 2], [3]], "answer": ["4", "4"], "level": [3, 3]}


def test_trl_gets_only_what_it_declares() -> None:
    seen: dict[str, Any] = {}

    def reward(prompts, completions, answer):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    values = score_group(reward, "trl", completions=["4", "5"], **GROUP)
    assert values.scores == (1.0, 0.0)
    assert seen["answer"] == ["4", "4"]


def test_trl_callable_object_and_chat_messages() -> None:
    class Judge:
        def __call__(self, completions, **kwargs):
            return [float(c[0]["content"] == "4") for c in completions]

    prompts, completions = chat_messages(GROUP["prompts"], ["4", "5"])
    assert completions[0] == [{"role": "assistant", "content": "4"}]
    assert prompts[0] == [{"role": "user", "content": "2+2="}]
    values = score_group(Judge(), "trl", **{**GROUP, "prompts": prompts},
                         completions=completions)
    assert values.scores == (1.0, 0.0)


def test_verl_compute_score_with_data_source_extra_info_and_a_dict() -> None:
    seen: list[dict[str, Any]] = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append({"data_source": data_source, "solution_str": solution_str,
                     "ground_truth": ground_truth, "extra_info": extra_info})
        hit = solution_str == ground_truth
        return {"score": float(hit), "acc": hit, "pred": solution_str}

    values = score_group(compute_score, "verl", completions=["4", "5"], data_source="arith",
                         **GROUP)
    assert values.scores == (1.0, 0.0)
    assert values.extra == {"acc": (1.0, 0.0)}  # "pred" is no number
    assert seen[1] == {"data_source": "arith", "solution_str": "5", "ground_truth": "4",
                       "extra_info": {"answer": "4", "level": 3}}
    columns = {"data_source": "gsm8k", "reward_model": {"ground_truth": "5"}}
    score_group(compute_score, "verl", **{**GROUP, "columns": columns}, completions=["5", "5"])
    assert seen[-1]["data_source"] == "gsm8k" and seen[-1]["ground_truth"] == "5"


def test_gsm8k_compute_score_gets_only_solution_and_ground_truth() -> None:
    seen: list[tuple[Any, ...]] = []

    def compute_score(solution_str, ground_truth, method="strict", format_score=0.0,
                      score=1.0):
        seen.append((solution_str, ground_truth, method, format_score, score))
        return score if solution_str.endswith(ground_truth) else format_score

    assert score_group(compute_score, "verl", completions=["so 4", "5"], **GROUP).scores \
        == (1.0, 0.0)
    assert seen[0] == ("so 4", "4", "strict", 0.0, 1.0)


def test_sample_style_by_name_and_by_position() -> None:
    def correctness(prompt, completion, answer):
        assert prompt == "2+2="
        return float(completion == answer)

    def positional(p, c, **columns):
        return float(c == columns["answer"]) + columns["level"]

    assert score_group(correctness, "sample", completions=["4", "5"], **GROUP).scores \
        == (1.0, 0.0)
    assert score_group(positional, "sample", completions=["4", "5"], **GROUP).scores \
        == (4.0, 3.0)


@pytest.mark.asyncio
async def test_async_variants_run_samples_concurrently() -> None:
    async def per_sample(prompt, completion, answer):
        await asyncio.sleep(0.2)
        return float(completion == answer)

    async def trl(completions, **kwargs):
        return [None] * len(completions)

    class AsyncJudge:
        async def __call__(self, completions):
            return [1.0] * len(completions)

    assert is_async_reward(per_sample) and is_async_reward(AsyncJudge())
    assert not is_async_reward(lambda p, c: 0.0)
    assert (await score_group_async(AsyncJudge(), "trl", completions=["4", "5"], **GROUP)
            ).scores == (1.0, 1.0)
    start = time.monotonic()
    values = await score_group_async(per_sample, "sample", completions=["4", "5", "4", "4"],
                                     **{**GROUP, "prompts": ["q"] * 4,
                                        "completion_ids": [[1]] * 4})
    assert values.scores == (1.0, 0.0, 1.0, 1.0)
    assert time.monotonic() - start < 0.6  # four 0.2 s calls side by side
    assert (await score_group_async(trl, "trl", completions=["4", "5"], **GROUP)).scores \
        == (None, None)


def test_wrong_shapes_raise_and_non_finite_scores_are_marked() -> None:
    def short(completions):
        return [1.0]

    with pytest.raises(RewardShapeError, match="list of 2 scores"):
        score_group(short, "trl", completions=["4", "5"], **GROUP)
    with pytest.raises(RewardShapeError, match="not a number"):
        score_group(lambda p, c: "high", "sample", completions=["4", "5"], **GROUP)
    with pytest.raises(RewardShapeError, match="'score' key"):
        score_group(lambda p, c: {"acc": 1}, "sample", completions=["4", "5"], **GROUP)
    values = score_group(lambda completions: [math.inf, 2], "trl", completions=["4", "5"],
                         **GROUP)
    assert values.scores == (None, 2.0) and values.nonfinite == (0,)


# --- loading specs: every bad one is one line naming the key -----------------------------


def test_load_reward_by_file_and_by_module(rewards_py: Path) -> None:
    fn = load_reward(spec(rewards_py, "correctness"))
    assert fn.__module__ == module_name_for(rewards_py.resolve())
    assert load_reward(spec(rewards_py, "correctness")) is fn  # loaded once
    assert load_reward(RewardSpec(function="math:isclose", style="sample")) is math.isclose
    assert reward_style(load_reward(spec(rewards_py, "judge"))) == "trl"
    decoded = msgspec.convert({"function": "f.py:g", "weight": 2}, RewardSpec)
    assert decoded == RewardSpec(function="f.py:g", weight=2.0)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"function": "f.py:g", "wieght": 2}, RewardSpec)


@pytest.mark.parametrize(("function", "why"), [
    ("my_rewards.py", "expected 'path/to/file.py:function'"),
    ("missing.py:f", "file not found: "),
    ("broken.py:f", "cannot import it: ImportError: no numpy here"),
    ("no_such_package_xyz.mod:f", "cannot import it: ModuleNotFoundError: No module named"),
    ("my_rewards.py:nope", "no 'nope' in "),
    ("my_rewards.py:not_a_function", "not_a_function is not callable (type int)"),
    ("my_rewards.py:no_params", "takes no parameters, so it cannot be given a completion"),
    ("my_rewards.py:secret", "required parameter(s) 'secret_column' are given by no"),
    ("my_rewards.py:one_positional", "takes 1 positional parameter(s)"),
])
def test_bad_specs_are_one_line_config_errors(rewards_py: Path, function: str,
                                              why: str) -> None:
    bad = RewardSpec(function=function)
    with pytest.raises(ConfigError) as info:
        load_reward(bad, index=2, base_dir=rewards_py.parent)
    message = str(info.value)
    assert message.startswith(f"config error: task.rewards[2].function = {function!r}: ")
    assert why in message and "\n" not in message


def test_non_finite_weight_and_clashing_names_are_config_errors(rewards_py: Path) -> None:
    with pytest.raises(ConfigError, match=r"task.rewards\[0\].weight = nan: "):
        load_reward(spec(rewards_py, "correctness", weight=math.nan))
    with pytest.raises(ConfigError, match=r"task.rewards\[1\].name = 'x': already the name"):
        RewardRunner([spec(rewards_py, "correctness", name="x"),
                      spec(rewards_py, "trl_len", name="x")], threads=True)


def test_unique_names() -> None:
    assert unique_names(["c", "c", "c", "d"], ["", "", "c_2", ""]) == ["c", "c_3", "c_2", "d"]


# --- the runner ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_runner_sums_weighted_rewards_in_processes(rewards_py: Path) -> None:
    runner = RewardRunner([spec(rewards_py, "correctness", weight=2.0),
                           spec(rewards_py, "correctness", weight=0.5),
                           spec(rewards_py, "trl_len", weight=1.0),
                           spec(rewards_py, "compute_score", weight=1.0, name="verl"),
                           spec(rewards_py, "async_trl", weight=-1.0)],
                          timeout_s=5.0, workers=2)
    try:
        assert runner.names == ("correctness", "correctness_2", "trl_len", "verl", "async_trl")
        result = await runner.score(completions=["4", "none"], data_source="arith", **GROUP)
    finally:
        runner.close()
    # sample 0: 2*1 + 0.5*1 + len("4") + 1 - 0.5; sample 1: 0 + 0 + None->0 + 0 - 0.5
    assert result.total == (4.0, -0.5)
    assert result.scores == {"correctness": (1.0, 0.0), "correctness_2": (1.0, 0.0),
                             "trl_len": (1.0, 0.0), "verl": (1.0, 0.0),
                             "async_trl": (0.5, 0.5), "verl/acc": (1.0, 0.0),
                             "verl/level": (3.0, 3.0)}
    assert (result.errors, result.timeouts, result.failed) == (0, 0, (False, False))


@pytest.mark.asyncio
async def test_failing_rewards_score_zero_and_are_counted(rewards_py: Path) -> None:
    runner = RewardRunner([spec(rewards_py, "boom"), spec(rewards_py, "sometimes_nan"),
                           spec(rewards_py, "trl_short"), spec(rewards_py, "correctness")],
                          timeout_s=5.0)
    try:
        result = await runner.score(completions=["4", "nan"], **GROUP)
    finally:
        runner.close()
    # boom: 2 samples; sometimes_nan: 1; trl_short's wrong length: the whole group (2)
    assert result.errors == 5 and result.timeouts == 0
    assert result.total == (2.0, 0.0)  # sometimes_nan's 1.0 + correctness' 1.0, then nothing
    assert result.failed == (True, True)
    # A lost score is None, never a 0 a mean would count.
    assert result.scores["boom"] == (None, None)
    assert result.scores["sometimes_nan"] == (1.0, None)
    assert result.scores["trl_short"] == (None, None)
    assert result.scores["correctness"] == (1.0, 0.0)


@pytest.mark.asyncio
async def test_sync_timeout_kills_the_process_and_the_next_call_works(rewards_py: Path) -> None:
    # One worker: the call after the timeout must run in a new process.
    runner = RewardRunner([spec(rewards_py, "slow"), spec(rewards_py, "pid", weight=0.0)],
                          timeout_s=0.5, workers=1)
    try:
        warm = await runner.score(completions=["4", "4"], **GROUP)  # the worker starts
        assert warm.total == (1.0, 1.0)
        start = time.monotonic()
        result = await runner.score(completions=["slow", "4"], **GROUP)
        assert time.monotonic() - start < 2.0
        assert (result.timeouts, result.errors, result.total) == (1, 0, (0.0, 1.0))
        assert result.failed == (True, False)
        again = await runner.score(completions=["4", "4"], **GROUP)
        assert again.total == (1.0, 1.0) and again.timeouts == 0
        assert again.scores["pid"] != warm.scores["pid"]  # the killed one replaced
    finally:
        runner.close()


@pytest.mark.asyncio
async def test_async_timeout_scores_zero_and_the_next_call_works(rewards_py: Path) -> None:
    runner = RewardRunner([spec(rewards_py, "slow_async")], timeout_s=0.5)
    try:
        start = time.monotonic()
        result = await runner.score(completions=["slow", "4"], **GROUP)
        assert time.monotonic() - start < 2.0
        assert (result.timeouts, result.errors, result.total) == (1, 0, (0.0, 2.0))
        again = await runner.score(completions=["4", "4"], **GROUP)
        assert again.total == (2.0, 2.0)
    finally:
        runner.close()


@pytest.mark.asyncio
async def test_callables_in_threads_with_chat_and_a_thread_timeout() -> None:
    def hung(prompt, completion):
        time.sleep(1.5 if completion == "slow" else 0)
        return 1.0

    def chat_trl(completions, **kwargs):
        return [float(c[0]["content"] == a) for c, a in
                zip(completions, kwargs["answer"], strict=True)]

    runner = RewardRunner([chat_trl, hung, lambda prompt, completion: 0.25],
                          weights=[1.0, 1.0, 4.0], timeout_s=0.5, threads=True, chat=True)
    try:
        assert runner.names == ("chat_trl", "hung", "reward")
        start = time.monotonic()
        result = await runner.score(completions=["4", "slow"], **GROUP)
        assert time.monotonic() - start < 1.4
    finally:
        runner.close()
    assert result.total == (3.0, 1.0) and result.timeouts == 1


@pytest.mark.asyncio
async def test_callables_travel_to_the_processes_pickled(rewards_py: Path) -> None:
    def make(bonus: float):
        def bonus_reward(prompt, completion, answer):
            return float(completion == answer) + bonus
        return bonus_reward

    judge = load_reward(spec(rewards_py, "judge"))  # by reference: the child loads its file
    with RewardRunner([make(0.5), judge], timeout_s=5.0, workers=1) as runner:
        assert runner.names == ("bonus_reward", "Judge")
        result = await runner.score(completions=["4", "5"], **GROUP)
    assert result.total == (2.5, 1.5) and result.errors == 0
    with pytest.raises(TypeError, match="takes no parameters"):
        RewardRunner([lambda: 1.0])


def test_the_examples_rewards_load_and_score_in_their_styles() -> None:
    """examples/verl_reward.toml's entry and examples/own_reward.py's TRL-style function."""
    root = Path(__file__).parents[2]
    toml = msgspec.toml.decode((root / "examples" / "verl_reward.toml").read_bytes())
    (entry,) = toml["task"]["rewards"]
    verl = load_reward(msgspec.convert(entry, RewardSpec), base_dir=root)
    assert reward_style(verl) == "verl"
    three = {**GROUP, "prompts": ["2+2="] * 3, "completion_ids": [[1], [2], [3]]}
    values = score_group(verl, "verl", completions=["4", " 5 apples", "four"], **three)
    assert values.scores == (1.0, 0.0, 0.0)
    assert values.extra == {"formatted": (1.0, 1.0, 0.0)}
    own = load_reward(RewardSpec(function=f"{root / 'examples' / 'own_reward.py'}:correctness"))
    assert reward_style(own) == "trl"
    completions = [[{"role": "assistant", "content": c}] for c in ("4", "5", "x")]
    scored = score_group(own, "trl", completions=completions, **three)
    assert scored.scores == (1.0, 0.0, 0.0)
