"""The run configuration: one tree of frozen Structs decoded from TOML.

Owns: the root ``Config``, which assembles every component's section (each lives beside
its component: ``workers.rollout.config``, ``workers.trainer.config``,
``workers.weights.config``, ``workers.model_config``, ``buffers.config``), the sections
of the application itself (``TaskConfig``: a tagged union of one section per task.kind,
so a key of another kind's is refused by its type; ``RunConfig``) and the rules that tie
sections together (``Config.__post_init__``), raising ``ConfigError`` with one line that
names the key. Reading a config from TOML with ``--set`` overrides, and writing one
back, is ``async_rl.config_io``'s. Knows nothing about what the knobs drive.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

import msgspec

from buffers.config import (
    ConfigError,
    Fraction,
    NonNegative,
    Positive,
    PositiveFloat,
    QueueConfig,
    StalenessConfig,
    invalid,
)
from workers.environment import EnvironmentConfig
from workers.model_config import ModelConfig
from workers.rewards.spec import RewardSpec
from workers.rollout.config import RolloutConfig
from workers.trainer.config import TrainerConfig
from workers.trainer.roles_config import AlgorithmConfig, CriticConfig, ReferenceConfig
from workers.weights.config import WeightsConfig

__all__ = ["Config", "ConfigError", "RunConfig", "SimulateConfig", "TaskConfig", "task_config"]


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


TaskConfig = (ArithmeticTaskConfig | LongtailTaskConfig | CalculatorTaskConfig
              | JsonlTaskConfig | DatasetTaskConfig)
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


class RunConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The run as a whole: length, seed, cluster and outputs."""

    num_steps: Positive = 20
    """Optimizer steps to run."""
    seed: NonNegative = 0
    """Seed of sampling and of the trainer."""
    output_dir: str = "runs/default"
    """Run directory: resolved config, metrics JSONL, ledger, spans, final model."""
    ray_address: str = ""
    """Address of an existing Ray cluster; empty starts a local one bound to 127.0.0.1."""
    num_cpus: NonNegative = 0
    """CPUs given to a local Ray (0 = what the roles need)."""
    colocate: bool | Literal["time"] = False
    """Rollout worker i and trainer shard i share devices (one STRICT_PACK placement
    group, both roles on the same cores at full width, at the same time); default is
    disaggregated, each role on its own devices. "time": the roles take turns on the
    same devices, engines releasing them for every training step and the weights
    copied within them (verl's hybrid engine); only ``async-rl simulate`` models it
    (docs/simulator.md), ``async-rl train`` refuses it."""
    progress: bool = True
    """Show a progress bar."""
    record_spans: bool = True
    """Record per-worker spans for idle accounting, the Perfetto trace and the timeline."""
    eval_every: NonNegative = 0
    """Evaluate greedy held-out accuracy every this many optimizer steps, beside training
    (where: run.eval_on; rows in eval.jsonl); 0 = only at the start and end."""
    eval_on: Literal["rollout", "idle_cpu"] = "rollout"
    """Where evaluations run. rollout: greedy on a rollout worker's engine, beside
    generation (weight updates landing meanwhile make a mixed-version row). idle_cpu: a
    process of its own scores exactly the version due with transformers on the CPU, at
    the OS's idle priority, so it runs only on cores the workers leave idle; its weights
    come from trainer shard 0 by reference. For small models on CPU machines."""
    target_accuracy: Fraction = 0.8
    """Held-out accuracy a run's time-to-target (and samples-to-target) is measured
    against, in summary.json."""
    checkpoint_every: NonNegative = 20
    """Write a checkpoint (RUN_DIR/checkpoints) every this many optimizer steps, besides
    the end of the run, a clean stop (Ctrl-C, SIGTERM) and a failure; 0 = only those.
    ``--resume`` continues from the newest good one. Periodic by default: a trainer
    shard that dies takes its weights with it, and with one shard the newest periodic
    checkpoint is then all that is left to resume from."""
    call_timeout_s: PositiveFloat = 300.0
    """Longest any other call to a worker may take (evaluation, saving, usage and span
    reads): past it the run stops, naming the call and the wait, instead of hanging. The
    workers' placement groups wait as long for the cluster to place them (past it: one
    line naming what was asked and what the cluster has, exit status 2)."""
    keep_checkpoints: Positive = 2
    """Checkpoints kept; older ones are removed once a new one is complete."""
    max_readmissions: NonNegative = 4
    """Times one prompt may run again after a drop or a failure (a stale drop, a group
    left with fewer than two members, a dead worker...); past it the prompt is dropped
    for good (ledger reason readmissions_exhausted, counted), so that no prompt is
    recycled forever."""
    stop_timeout_s: PositiveFloat = 60.0
    """After a graceful stop (Ctrl-C, SIGTERM), how long the run waits for the step in
    progress to get its groups; past it the step is abandoned, the last consistent
    checkpoint is written and the run exits as a clean stop does."""
    save_merged: bool = False
    """With LoRA (model.lora.rank > 0): besides the adapter (peft's format) in
    RUN_DIR/final_model, write the policy with the adapters merged into the base weights,
    a plain Hugging Face model, in RUN_DIR/final_model/merged."""
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl",)
    """Where metrics go: "jsonl" (metrics.jsonl, always written: the reports read it),
    "tensorboard" (an event file in RUN_DIR/tensorboard) and "wandb" (a W&B run in
    RUN_DIR/wandb; WANDB_MODE=offline needs no network). The last two need the
    ``loggers`` extra: pip install 'async-rl[loggers]'."""

    def __post_init__(self) -> None:
        if "jsonl" not in self.loggers or len(set(self.loggers)) < len(self.loggers):
            raise invalid("run.loggers", list(self.loggers),
                           'must list "jsonl" (always written: the reports read it) '
                           "and no logger twice")


NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class HardwareOverrides(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                        omit_defaults=True):
    """``[simulate.hardware_overrides]``: any key of the hardware file, replacing its
    value (``--set simulate.hardware_overrides.train_mfu=0.2``); unset keys keep the
    file's. Each key means what it means in the file (docs/simulator.md, "The cost
    model")."""

    devices_per_rollout_worker: Positive | None = None
    devices_per_trainer_shard: Positive | None = None
    peak_flops: PositiveFloat | None = None
    memory_bandwidth: PositiveFloat | None = None
    interconnect_bandwidth: PositiveFloat | None = None
    train_mfu: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    decode_mfu: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    memory_efficiency: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    device_memory: NonNegativeFloat | None = None
    engine_release_s: NonNegativeFloat | None = None
    engine_reload_s: NonNegativeFloat | None = None
    decode_step_s: NonNegativeFloat | None = None
    micro_batch_s: NonNegativeFloat | None = None
    update_s: NonNegativeFloat | None = None
    publish_s: NonNegativeFloat | None = None
    weight_load_s: NonNegativeFloat | None = None
    weight_member_s: NonNegativeFloat | None = None
    call_s: NonNegativeFloat | None = None
    cores: NonNegative | None = None
    engine_processes: PositiveFloat | None = None
    contention: NonNegativeFloat | None = None


class SimulateConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``async-rl simulate`` needs besides the run's own sections: the hardware,
    the lengths and the model's size (``async-rl train`` ignores this section)."""

    hardware: str = "cpu"
    """A hardware file (TOML: devices per worker, peak FLOP/s, memory bandwidth, MFUs,
    interconnect bandwidth, fixed overheads; docs/simulator.md), or a shipped one by name:
    cpu (this project's 2-core test machine, calibrated), h100, h200, a100, h20."""
    lengths: str = "task"
    """Where completion lengths come from: "task" (the built-in task's reference
    completions: arithmetic, longtail), "lognormal" (simulate.length_median and
    length_sigma), "empirical" (drawn from simulate.length_values), "file:PATH" (drawn
    from the integers in a text file: a dataset's reference lengths, counted with its
    tokenizer), or a run directory, whose ledger's generated lengths are replayed prompt
    by prompt. All are capped at rollout.max_new_tokens."""
    length_median: PositiveFloat = 200.0
    """Median completion tokens of lengths = "lognormal"."""
    length_sigma: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """Standard deviation of log(length) of lengths = "lognormal"."""
    group_spread: Annotated[float, msgspec.Meta(ge=0)] = 0.3
    """lognormal: the part of length_sigma shared by a group's samples is the rest; this
    is the standard deviation of log(length) between samples of one prompt."""
    length_values: tuple[Annotated[int, msgspec.Meta(ge=1)], ...] = ()
    """The completion lengths lengths = "empirical" draws from."""
    prompt_tokens: NonNegative = 0
    """Tokens of every prompt; 0 = each prompt's text length in bytes (the byte-level
    tokenizer of the built-in models)."""
    hardware_overrides: HardwareOverrides = msgspec.field(default_factory=HardwareOverrides)
    """Keys of the hardware file replaced for this run (``[simulate.hardware_overrides]``
    or ``--set simulate.hardware_overrides.KEY=VALUE``): devices per rollout worker and
    per trainer shard, MFUs, bandwidths, device memory, fixed overheads."""
    parameters: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Model parameters (all of them: what the weights weigh, in memory and on the wire);
    0 = counted from model.path's config.json."""
    active_parameters: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Parameters one token passes through (a mixture of experts': the shared ones and
    the experts routed to): what training and decode FLOPs count; 0 = all of them
    (simulate.parameters). Expert parallelism is not modelled: an engine or a trainer
    shard holds every expert."""
    kv_bytes_per_token: NonNegative = 0
    """KV-cache bytes one token of context holds (2 x layers x kv heads x head dim x
    bytes); 0 = from model.path's config.json."""
    attention_width: NonNegative = 0
    """Layers x query heads x head dim: training a sequence of T tokens costs 6 x this x
    T^2 FLOPs of causal attention besides 6 x parameters x T; 0 = from model.path's
    config.json, or not counted when it has none."""
    reward_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Reward (or tool) latency of a group after its last sample; the engine goes on
    generating meanwhile."""
    reward_p: Fraction = 0.5
    """Chance that a sample scores 1. Learning is not simulated: held-out accuracy stays
    at this value."""
    detail: Positive = 16
    """Rollout engines the trace (trace.json) shows one by one when there are more:
    this many evenly spaced ranks, plus the most idle few; every trainer shard is kept,
    and idle.json and the idle table account for every device. Past 16 devices the
    timeline draws one row per role and the most idle devices. (Read by the report of
    any run directory, real or simulated.)"""


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole run configuration."""

    model: ModelConfig
    task: TaskConfig = msgspec.field(default_factory=ArithmeticTaskConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    queue: QueueConfig = msgspec.field(default_factory=QueueConfig)
    staleness: StalenessConfig = msgspec.field(default_factory=StalenessConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    reference: ReferenceConfig = msgspec.field(default_factory=ReferenceConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    critic: CriticConfig = msgspec.field(default_factory=CriticConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    simulate: SimulateConfig = msgspec.field(default_factory=SimulateConfig)

    def __post_init__(self) -> None:
        if self.queue.max_groups < self.trainer.groups_per_step:
            raise invalid(
                "queue.max_groups",
                self.queue.max_groups,
                f"must be >= trainer.groups_per_step ({self.trainer.groups_per_step}),"
                " or a training step could never fill",
            )
        if self.weights.sync_every - 1 > self.staleness.max_staleness:
            raise invalid(
                "weights.sync_every",
                self.weights.sync_every,
                f"must be <= staleness.max_staleness + 1 ({self.staleness.max_staleness + 1}):"
                " rollout would run weights older than the staleness bound allows",
            )
        if self.weights.transport == "ipc" and not (
                self.run.colocate and self.rollout.num_workers == 1
                and self.trainer.num_shards == 1):
            raise invalid("weights.transport", self.weights.transport,
                           "needs run.colocate = true, rollout.num_workers = 1 and "
                           "trainer.num_shards = 1 (CUDA IPC shares the trainer's own GPU "
                           'with one engine); use "nccl" otherwise')
        if self.weights.transport == "nccl" and self.run.colocate is True:
            raise invalid("weights.transport", self.weights.transport,
                          "not with run.colocate = true: rollout worker i and trainer shard "
                          "i share one GPU, and NCCL refuses two ranks on one GPU "
                          '("Duplicate GPU detected"); use "ipc" (one pair) or "gloo"')
        if self.trainer.micro_batch_tokens < self.rollout.max_new_tokens:
            raise invalid(
                "trainer.micro_batch_tokens",
                self.trainer.micro_batch_tokens,
                f"must be >= rollout.max_new_tokens ({self.rollout.max_new_tokens})",
            )
        env = self.task.environment
        if env.enabled and self.run.eval_on == "idle_cpu":
            raise invalid("run.eval_on", self.run.eval_on,
                          'the idle-CPU evaluator generates single-turn: use "rollout" '
                          "with task.environment")
        if env.enabled and env.max_trajectory_tokens > self.trainer.micro_batch_tokens:
            raise invalid("task.environment.max_trajectory_tokens", env.max_trajectory_tokens,
                          f"must be <= trainer.micro_batch_tokens "
                          f"({self.trainer.micro_batch_tokens}): a trajectory is one "
                          "training sequence")
        if self.run.save_merged and not self.model.lora.enabled:
            raise invalid("run.save_merged", True, "only with LoRA (model.lora.rank > 0): "
                          "without it final_model is the whole policy already")
        if self.model.lora.enabled and self.weights.transport != "gloo":
            raise invalid("weights.transport", self.weights.transport,
                          'LoRA (model.lora.rank > 0) delivers adapter versions over "gloo" '
                          "only, so far (docs/lora.md)")
        buffer, limit = self.trainer.overlong_buffer, self.rollout.max_new_tokens
        if buffer >= limit:
            raise invalid("trainer.overlong_buffer", buffer,
                          f"must be below rollout.max_new_tokens ({limit})")
        self._check_roles()
        if self.trainer.overlong == "penalty" and buffer == 0:
            raise invalid("trainer.overlong_buffer", buffer,
                          f'required with trainer.overlong = "penalty": 1 to {limit - 1} '
                          "tokens (below rollout.max_new_tokens)")

    @property
    def has_reference(self) -> bool:
        """A reference policy is built: the KL term needs one, and a reference.path set
        with trainer.kl_coef = 0 measures the KL without penalising it."""
        return self.trainer.kl_coef > 0 or bool(self.reference.path)

    @property
    def has_critic(self) -> bool:
        return self.algorithm.advantage == "gae"

    def with_role_paths(self) -> Config:
        """This config with reference.path and critic.path ("" = the policy's initial
        weights) set to model.path where their role is built: a resumed run's workers
        start the policy from a checkpoint, and the reference must stay the initial
        policy."""
        reference, critic = self.reference, self.critic
        if self.has_reference and not reference.path:
            reference = msgspec.structs.replace(reference, path=self.model.path)
        if self.has_critic and not critic.path:
            critic = msgspec.structs.replace(critic, path=self.model.path)
        return msgspec.structs.replace(self, reference=reference, critic=critic)

    def _check_roles(self) -> None:
        """The reference and the critic sit beside the trainer shards, on the packed
        layout, as DDP replicas."""
        trainer = self.trainer
        if trainer.kl_in_reward and not self.has_critic:
            raise invalid("trainer.kl_in_reward", True,
                          'needs algorithm.advantage = "gae" (a per-token reward needs '
                          "per-token advantages); GRPO takes the KL as a loss term")
        for role, placement, wanted in (("reference", self.reference.placement,
                                         self.has_reference),
                                        ("critic", self.critic.placement, self.has_critic)):
            if wanted and placement == "own":
                raise invalid(f"{role}.placement", placement,
                              'not built yet: use "trainer" (its forward runs on the '
                              "trainer shards' devices)")
        if not (self.has_reference or self.has_critic):
            return
        why = "the reference" if self.has_reference else "the critic"
        if not trainer.packed:
            raise invalid("trainer.packed", False,
                          f"{why} computes on the packed micro-batches: needs true")
        if self.has_critic and trainer.backend != "ddp":
            raise invalid("trainer.backend", trainer.backend,
                          'the critic is built for "ddp" only')
        if self.has_critic and self.critic.num_shards != trainer.num_shards:
            raise invalid("critic.num_shards", self.critic.num_shards,
                          f'with critic.placement = "trainer" one critic shard sits beside '
                          f"each trainer shard: must equal trainer.num_shards "
                          f"({trainer.num_shards})")
