"""The task table: every task.kind, what its prompts, reward and environment are built from.

Owns: ``TASKS``, a plain dict from task.kind to that kind's ``TaskKind`` (its builder,
the check of its inputs before a run, its reference completion lengths for the
simulator, its own environment), ``build_task`` (a config's prompt source, reward and
held-out prompts: the shell, the simulator and the benchmarks build a task through it),
``check_task`` (``async_rl.run.inputs``' check of the task's files) and ``worker_task``
(what the rollout workers and the evaluator get of the task). This module is the one
place a task's kind picks what happens; each kind's section (``async_rl.task_config``) holds
only its own keys. Knows nothing about Ray, engines or the run's loops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from async_rl.config import Config
from async_rl.task_config import (
    AgentTaskConfig,
    CalculatorTaskConfig,
    DatasetTaskConfig,
    JsonlTaskConfig,
    TaskConfig,
    TaskSection,
)
from async_rl.tasks.agent_rows import AgentRowSource, read_agent_rows
from async_rl.tasks.calculator import (
    BUILT_IN_ENV,
    CalculatorTask,
    calculator_reward,
    environment_factory,
)
from async_rl.tasks.dataset import DatasetPromptSource, load_dataset_task, model_fit, open_dataset
from async_rl.tasks.longtail import RemainderTask, parse_prompt, reference_completion
from async_rl.tasks.rewards import arithmetic_reward, gsm8k_reward, remainder_reward
from async_rl.tasks.sources import (
    ArithmeticTask,
    JsonlPromptSource,
    PromptFileError,
    PromptSource,
    read_prompt_file,
)
from buffers.common.config import ConfigError
from buffers.common.records import Prompt
from workers.common.user_code import absolute_target
from workers.rewards.callables import Reward
from workers.rewards.function import RewardFn
from workers.rewards.runner import UserRewards
from workers.rewards.spec import DEFAULT_COLUMNS, absolute_spec
from workers.rollout.agents import AgentConfig, agent_function
from workers.rollout.prompts import PromptFormat
from workers.rollout.task import WorkerTask, named_environment


class Task(NamedTuple):
    """A task as a run uses it: its prompts, its built-in reward, its held-out prompts."""

    source: PromptSource
    reward_fn: RewardFn
    eval_prompts: tuple[Prompt, ...]


@dataclass(frozen=True)
class TaskKind:
    """One row of the task table."""

    build: Callable[[Any, str, int], Task]
    """(the kind's section, model.path, rollout.max_new_tokens) -> the task."""
    check: Callable[[Any], tuple[str, ...]] | None = None
    """Reads the kind's files before a run (a bad one: ``ConfigError``); returns the
    columns every row gives the rewards. None: no files, the default columns."""
    reference_length: Callable[[Prompt], int] | None = None
    """The length of a prompt's reference completion, EOS included, in the tiny model's
    one-character tokens (``async-rl simulate``'s lengths = "task"). None: no reference."""
    own_environment: Callable[[Any, int], Callable[[], Any] | None] | None = None
    """(section, rollout worker rank) -> how that worker builds each trajectory's
    environment when the kind has its own; None: the class task.environment names."""


def _arithmetic(task: TaskSection, model_path: str, max_new_tokens: int) -> Task:
    arithmetic = ArithmeticTask(seed=task.seed)
    return Task(arithmetic, arithmetic_reward, arithmetic.eval_prompts(task.eval_size))


def _longtail(task: TaskSection, model_path: str, max_new_tokens: int) -> Task:
    longtail = RemainderTask(seed=task.seed)
    return Task(longtail, remainder_reward, longtail.eval_prompts(task.eval_size))


def _calculator(task: CalculatorTaskConfig, model_path: str, max_new_tokens: int) -> Task:
    calculator = CalculatorTask(seed=task.seed)
    return Task(calculator, calculator_reward, calculator.eval_prompts(task.eval_size))


def _calculator_environment(task: CalculatorTaskConfig,
                            rank: int) -> Callable[[], Any] | None:
    # The built-in environment with task.tool_latency_ms, its latencies seeded per worker.
    if task.environment.class_ != BUILT_IN_ENV:
        return None
    return environment_factory(task.tool_latency_ms, seed=task.seed + rank)


def _jsonl(task: JsonlTaskConfig, model_path: str, max_new_tokens: int) -> Task:
    source = JsonlPromptSource(task.jsonl_path, seed=task.seed)
    held_out = tuple(source.prompt_at(i) for i in range(min(task.eval_size, len(source))))
    return Task(source, gsm8k_reward, held_out)


def _check_jsonl(task: JsonlTaskConfig) -> tuple[str, ...]:
    if not Path(task.jsonl_path).is_file():
        raise ConfigError(f"config error: task.jsonl_path = {task.jsonl_path!r}: file not found")
    try:
        read_prompt_file(task.jsonl_path)
    except PromptFileError as err:
        raise ConfigError(f"prompt file error: {err}") from None
    return DEFAULT_COLUMNS


def _dataset(task: DatasetTaskConfig, model_path: str, max_new_tokens: int) -> Task:
    data = load_dataset_task(task, model_fit(model_path, task, max_new_tokens))
    return Task(data.source, gsm8k_reward, data.eval_prompts)


def _check_dataset(task: DatasetTaskConfig) -> tuple[str, ...]:
    rows, held = open_dataset(task)
    for data in (rows, held):  # the first row tells a wrong kind of prompt column
        if data is not None:
            data.prompt(0, "check")
    return rows.reward_columns


def _agent(task: AgentTaskConfig, model_path: str, max_new_tokens: int) -> Task:
    source = AgentRowSource(task.path, seed=task.seed)
    held = AgentRowSource(task.eval_path, shuffle=False) if task.eval_path else source
    return Task(source, _agent_scores, held.eval_prompts(task.eval_size))


def _agent_scores(prompt: Prompt, completion_text: str) -> float:
    # Never called: an agent's solve returns its trajectory's reward.
    raise RuntimeError("an agent task's rewards come from its solve")


def _check_agent(task: AgentTaskConfig) -> tuple[str, ...]:
    for key, path in (("path", task.path), ("eval_path", task.eval_path)):
        if path and not Path(path).is_file():
            raise ConfigError(f"config error: task.{key} = {path!r}: file not found")
        try:
            if path:
                read_agent_rows(path)
        except PromptFileError as err:
            raise ConfigError(f"prompt file error: {err}") from None
    agent_function(task.agent)  # ConfigError naming task.agent
    return DEFAULT_COLUMNS


def _answer_length(prompt: Prompt) -> int:
    return len(prompt.answer) + 1


def _remainder_length(prompt: Prompt) -> int:
    return len(reference_completion(*parse_prompt(prompt.text))) + 1


TASKS: dict[str, TaskKind] = {
    "arithmetic": TaskKind(build=_arithmetic, reference_length=_answer_length),
    "longtail": TaskKind(build=_longtail, reference_length=_remainder_length),
    "calculator": TaskKind(build=_calculator, own_environment=_calculator_environment),
    "jsonl": TaskKind(build=_jsonl, check=_check_jsonl),
    "dataset": TaskKind(build=_dataset, check=_check_dataset),
    "agent": TaskKind(build=_agent, check=_check_agent),
}
"""Every task.kind (the keys of ``async_rl.task_config.TASK_SECTIONS``) and its row."""


def build_task(config: Config) -> Task:
    """The prompt source, its reward function and the held-out evaluation prompts of
    ``config.task`` (a dataset's too-long prompts, for ``config.model`` and
    rollout.max_new_tokens, refused here)."""
    task = config.task
    return TASKS[task.kind].build(task, config.model.path, config.rollout.max_new_tokens)


def check_task(task: TaskConfig) -> tuple[str, ...]:
    """Reads the task's files (``ConfigError`` in one line on a bad one) and returns the
    columns every prompt gives the rewards."""
    check = TASKS[task.kind].check
    return check(task) if check is not None else DEFAULT_COLUMNS


def reference_length(task: TaskConfig) -> Callable[[Prompt], int] | None:
    """How long the task's reference completion of a prompt is (None: it has none)."""
    return TASKS[task.kind].reference_length


def worker_task(task: TaskConfig, built: Task, rewards: Sequence[Reward] = (),
                model_name: str = "") -> WorkerTask:
    """What the workers get of ``task`` built as ``built``; ``rewards``: a script's reward
    callables, besides task.rewards; ``model_name``: the name an agent task's gateway
    serves the policy under (model.path as the config gives it)."""
    columns = (built.source.columns if isinstance(built.source, DatasetPromptSource)
               else DEFAULT_COLUMNS)
    user = None
    if task.rewards or rewards:
        user = UserRewards(specs=(*(absolute_spec(s) for s in task.rewards), *rewards),
                           timeout_s=task.reward_timeout_s, workers=task.reward_workers,
                           threads=task.reward_threads, chat=task.chat_template,
                           columns=columns, eval_reward=task.eval_reward)
    own = TASKS[task.kind].own_environment
    env = task.environment
    return WorkerTask(
        reward_fn=built.reward_fn, user_rewards=user,
        prompt_format=PromptFormat(chat_template=task.chat_template,
                                   system_prompt=task.system_prompt),
        environment=env.absolute() if env.enabled else None,
        own_environment=functools.partial(own, task) if own is not None
        else named_environment,
        agent=_agent_config(task) if isinstance(task, AgentTaskConfig) else None,
        model_name=model_name)


def _agent_config(task: AgentTaskConfig) -> AgentConfig:
    env = task.environment
    return AgentConfig(agent=absolute_target(task.agent), agent_timeout_s=task.agent_timeout_s,
                       max_turns=task.max_turns, max_trajectory_tokens=env.max_trajectory_tokens,
                       on_timeout=env.on_timeout, on_error=env.on_error)
