"""The ``[task]`` section: a tagged union of one section per task.kind.

Owns: ``TaskSection`` (the keys every kind shares), one section per kind (``arithmetic``,
``longtail``, ``calculator``, ``jsonl``, ``dataset``, ``agent``), ``TaskConfig`` (their union, tag
``kind``, so a key of another kind's is refused by its type), ``TASK_SECTIONS`` and
``task_config`` for Python callers. The root ``async_rl.config.Config`` holds it; what
each kind builds is ``async_rl.tasks.table``'s.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

import msgspec

from buffers.common.config import NonNegative, Positive, PositiveFloat, invalid
from workers.rewards.spec import RewardSpec
from workers.rollout.environment import EnvironmentConfig


class TaskSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                  tag_field="kind"):
    """Where prompts come from and how completions are scored: the keys every task.kind
    has. ``kind`` picks the section (below), and a key of another kind's is refused."""

    seed: NonNegative = 0
    """Seed of the prompt stream (the arithmetic task is a pure function of seed and index)."""
    eval_size: NonNegative = 200
    """Held-out prompts scored greedily at the start and end of a run, and every
    run.eval_every steps (0 = no evaluation)."""
    chat_template: bool = False
    """Render every prompt with the tokenizer's chat template (add_generation_prompt),
    once, on the rollout side, the same for training and evaluation; the model's
    tokenizer must have one. Off: prompts go to the model as raw text."""
    system_prompt: str = ""
    """Prepended to every prompt as a system message (needs task.chat_template = true;
    a prompt whose messages start with a system message keeps its own)."""
    rewards: tuple[RewardSpec, ...] = ()
    """Your own reward functions (``[[task.rewards]]`` entries: function, weight, name,
    style), in TRL, verl or per-sample style, sync or async; summed by weight, each one's
    mean logged per step as reward/<name>. They replace the task's built-in reward, in
    training and in evaluations. Empty: the built-in reward."""
    reward_timeout_s: PositiveFloat = 30.0
    """Longest one reward call may take; past it the samples it scores get 0 and are
    counted (reward_timeouts), and the call's process is replaced."""
    reward_workers: Positive = 2
    """Processes (or threads) per rollout worker that run the sync rewards of
    task.rewards, off the engine's event loop; async rewards run on an event loop of
    their own."""
    reward_threads: bool = False
    """Run sync rewards in threads instead of processes (no pickling, shared memory; a
    CPU-bound Python reward then holds the engine process's GIL, and a call past the
    timeout cannot be stopped)."""
    on_reward_failure: Literal["exclude", "zero"] = "exclude"
    """A sample whose reward call raised, returned a non-finite value or ran past
    task.reward_timeout_s: "exclude" leaves it out of its group (no advantage, no loss,
    not in the group's mean and std; a group left with fewer than two members runs
    again), "zero" trains it with reward 0 (a slow verifier then pushes correct answers
    down). Counted either way (reward_errors, reward_timeouts)."""
    eval_reward: str = ""
    """The name of one of task.rewards whose mean over greedy completions is the
    evaluations' accuracy; "" = the weighted sum of all of them (or the built-in
    reward)."""
    environment: EnvironmentConfig = msgspec.field(default_factory=EnvironmentConfig)
    """Multi-turn rollouts with an environment (``[task.environment]``, below): the
    prompt source's rows go to its reset, and every turn's completion to its step."""

    @property
    def kind(self) -> str:
        """The task's kind, as written in ``[task]``: which section this is."""
        return str(self.__struct_config__.tag)

    def __post_init__(self) -> None:
        if self.system_prompt and not self.chat_template:
            raise invalid("task.system_prompt", self.system_prompt,
                          "needs task.chat_template = true (it is a system message)")
        if self.eval_reward and not self.rewards:
            raise invalid("task.eval_reward", self.eval_reward,
                          "names one of task.rewards, and there are none")


class ArithmeticTaskConfig(TaskSection, frozen=True, kw_only=True, tag="arithmetic"):
    """task.kind = "arithmetic" (the default): the built-in seeded arithmetic task
    (answers of a few tokens)."""


class LongtailTaskConfig(TaskSection, frozen=True, kw_only=True, tag="longtail"):
    """task.kind = "longtail": the built-in long-tail reasoning task (remainders by
    repeated subtraction: traces of 20 to 300 tokens)."""


class CalculatorTaskConfig(TaskSection, frozen=True, kw_only=True, tag="calculator"):
    """task.kind = "calculator": the built-in calculator tool task (expressions of 2 to 4
    terms, too long to do in one's head, with a tool called as <call>expr</call>; see
    docs/calculator.md)."""

    tool_latency_ms: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    """Median latency of one calculator tool call, in milliseconds: each call sleeps a
    log-normal draw with this median and a heavy tail (sigma 1: mean 1.65x the median,
    99th percentile about 10x), seeded by task.seed, to emulate a remote sandbox. 0 = the
    tool answers at once."""


class JsonlTaskConfig(TaskSection, frozen=True, kw_only=True, tag="jsonl"):
    """task.kind = "jsonl": a JSONL file of {"prompt", "answer"} lines."""

    jsonl_path: str = ""
    """The JSONL prompt file (required)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.jsonl_path:
            raise invalid("task.jsonl_path", self.jsonl_path, 'required when task.kind = "jsonl"')


class DatasetTaskConfig(TaskSection, frozen=True, kw_only=True, tag="dataset"):
    """task.kind = "dataset": your own dataset (task.path, read with the datasets library;
    see docs/datasets.md)."""

    path: str = ""
    """The dataset (required): a .jsonl, .json, .parquet or .csv file, or a directory
    written by datasets' save_to_disk. Its rows are shuffled anew (seeded by task.seed)
    every pass."""
    prompt_key: str = "prompt"
    """The dataset's prompt column: strings, or chat messages ([{"role", "content"},
    ...], which need task.chat_template = true)."""
    answer_key: str = "answer"
    """The dataset's answer column, handed to rewards as ``answer`` (and as verl's
    ``ground_truth``) and under its own name (TRL's ``solution``); "" for a dataset
    without one (task.rewards then score it; a column named ``answer`` reaches them as
    it is). Every other column reaches the rewards under its own name."""
    eval_path: str = ""
    """A held-out dataset (same formats and columns) whose first task.eval_size rows are
    the evaluation prompts. Without it or task.eval_fraction, the first task.eval_size
    training rows are (and are trained on too)."""
    eval_fraction: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    """Hold out this fraction of task.path's rows (a split seeded by task.seed) for
    evaluation; they are never trained on. 0 = no split."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.path:
            raise invalid("task.path", self.path, 'required when task.kind = "dataset"')
        if not self.prompt_key:
            raise invalid("task.prompt_key", self.prompt_key, "must name a column")
        if self.eval_path and self.eval_fraction:
            raise invalid("task.eval_fraction", self.eval_fraction,
                          "give task.eval_path or task.eval_fraction, not both")
        if not self.answer_key and not self.rewards:
            raise invalid("task.answer_key", self.answer_key,
                          "the built-in reward checks the answer: name the answer column, "
                          "or score with task.rewards")


class AgentTaskConfig(TaskSection, frozen=True, kw_only=True, tag="agent"):
    """task.kind = "agent": your own agent code plays each trajectory through the run's
    OpenAI-compatible gateway (see docs/agents.md); task.environment's on_timeout,
    on_error and max_trajectory_tokens apply to it."""

    path: str = ""
    """A JSONL file of rows (JSON objects), one trajectory group per row; each row goes
    to the agent as it is (required)."""
    agent: str = ""
    """The agent: "my_agent.py:solve" or "package.module:solve", an ``async def
    solve(client: openai.AsyncOpenAI, row: dict) -> float | async_rl.AgentResult``
    (required)."""
    agent_timeout_s: PositiveFloat = 300.0
    """A trajectory's whole life (every call of solve); past it the trajectory ends and
    task.environment.on_timeout applies (counted, env_timeouts)."""
    max_turns: Positive = 16
    """Requests one trajectory may make; past them the gateway answers 409."""
    eval_path: str = ""
    """Held-out rows (same format) whose first task.eval_size are the evaluation
    prompts, each played once by the agent with greedy requests; "": the first
    task.eval_size rows of task.path (trained on too)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.path:
            raise invalid("task.path", self.path, 'required when task.kind = "agent"')
        if not self.agent:
            raise invalid("task.agent", self.agent, 'required when task.kind = "agent"')
        if self.rewards:
            raise invalid("task.rewards", "[...]", "an agent's solve returns the reward: "
                          'no task.rewards with task.kind = "agent"')
        if self.environment.enabled:
            raise invalid("task.environment.class", self.environment.class_,
                          'an agent plays no environment: with task.kind = "agent" only '
                          "on_timeout, on_error and max_trajectory_tokens apply")


TaskConfig = (ArithmeticTaskConfig | LongtailTaskConfig | CalculatorTaskConfig
              | JsonlTaskConfig | DatasetTaskConfig | AgentTaskConfig)
"""The ``[task]`` section: one of the per-kind sections, picked by its ``kind`` key
(``arithmetic`` when the table has none)."""

TASK_SECTIONS: dict[str, type[TaskSection]] = {
    str(section.__struct_config__.tag): section for section in typing.get_args(TaskConfig)}
"""Each task.kind's section, by kind."""
DEFAULT_TASK_KIND = "arithmetic"
"""The kind of a ``[task]`` table that names none."""


def unknown_task_key(kind: str, key: str, value: object) -> ValueError:
    """The one line refusing ``task.<key>`` in a task of ``kind`` that has no such key,
    naming the kinds that have it."""
    owners = [f'task.kind = "{k}"' for k, section in TASK_SECTIONS.items()
              if key in section.__struct_fields__]
    where = f" (only for {' or '.join(owners)})" if owners else ""
    return invalid(f"task.{key}", value, f'not a key of task.kind = "{kind}"{where}')


def task_config(**fields: Any) -> TaskConfig:
    """A task section from keyword arguments, as a ``[task]`` table gives them (``kind``
    picks the section): for Python callers. A key of another kind's is refused as the
    sections' own rules refuse a value: a ``ValueError`` of one line naming it."""
    kind = str(fields.pop("kind", DEFAULT_TASK_KIND))
    section = TASK_SECTIONS.get(kind)
    if section is None:
        raise invalid("task.kind", kind, f"expected one of {', '.join(map(repr, TASK_SECTIONS))}")
    for key, value in fields.items():
        if key not in section.__struct_fields__:
            raise unknown_task_key(kind, key, value)
    return typing.cast(TaskConfig, section(**fields))
