"""The run configuration: one tree of frozen Structs decoded from TOML.

Owns: the root ``Config``, which assembles every component's section (each lives beside
its component: ``workers.rollout.config``, ``workers.trainer.config``,
``workers.weights.config``, ``workers.model_config``, ``buffers.common.config``; the task's in
``async_rl.task_config``, the simulator's in ``async_rl.simulate_config``), the run's own
section (``RunConfig``) and the rules that tie
sections together (``Config.__post_init__``), raising ``ConfigError`` with one line that
names the key. Reading a config from TOML with ``--set`` overrides, and writing one
back, is ``async_rl.config_io``'s. Knows nothing about what the knobs drive.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from async_rl.simulate_config import HardwareOverrides, SimulateConfig
from async_rl.task_config import (
    DEFAULT_TASK_KIND,
    TASK_SECTIONS,
    ArithmeticTaskConfig,
    TaskConfig,
    task_config,
    unknown_task_key,
)
from buffers.common.config import (
    ConfigError,
    Fraction,
    NonNegative,
    Positive,
    PositiveFloat,
    QueueConfig,
    StalenessConfig,
    invalid,
)
from workers.model_config import ModelConfig
from workers.rollout.config import RolloutConfig
from workers.trainer.config import TrainerConfig
from workers.trainer.roles_config import AlgorithmConfig, CriticConfig, ReferenceConfig
from workers.weights.config import WeightsConfig

# The sections kept in modules of their own are named here too: callers import every
# section from the one config module.
__all__ = ["DEFAULT_TASK_KIND", "TASK_SECTIONS", "AutopilotConfig", "Config", "ConfigError",
           "HardwareOverrides", "RunConfig", "SimulateConfig", "TaskConfig", "task_config",
           "unknown_task_key"]


CATCHABLE_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGCONT",
                     "SIGXCPU")
"""What run.stop_signal may name: signals a scheduler sends as a warning that a process
can catch (SIGINT and SIGTERM stop a run anyway)."""


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
    """Record per-worker spans for idle accounting, the Perfetto trace and the timeline
    (and, for an agent task, each engine's agent sessions and their turns for the
    trace)."""
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
    stop_signal: str = ""
    """A further signal that stops the run as Ctrl-C does (after the step in progress,
    a checkpoint, then exit 128 + its number), e.g. "SIGUSR1" for a scheduler's warning
    before its time limit (Slurm: ``sbatch --signal=B:USR1@90``); "": SIGINT and SIGTERM
    only."""
    save_merged: bool = False
    """With LoRA (model.lora.rank > 0): besides the adapter (peft's format) in
    RUN_DIR/final_model, write the policy with the adapters merged into the base weights,
    a plain Hugging Face model, in RUN_DIR/final_model/merged."""
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl",)
    """Where metrics go: "jsonl" (metrics.jsonl, always written: the reports read it),
    "tensorboard" (an event file in RUN_DIR/tensorboard) and "wandb" (a W&B run in
    RUN_DIR/wandb; WANDB_MODE=offline needs no network). The last two need the
    ``loggers`` extra: pip install 'async-rl[loggers]'."""

    @property
    def shares_devices(self) -> bool:
        """Rollout worker i and trainer shard i run on the same devices (colocate true:
        at once; "time": taking turns, the simulator only)."""
        return self.colocate is not False

    def __post_init__(self) -> None:
        if self.stop_signal and self.stop_signal not in CATCHABLE_SIGNALS:
            raise invalid("run.stop_signal", self.stop_signal,
                          f"must be one of {', '.join(CATCHABLE_SIGNALS)}")
        if "jsonl" not in self.loggers or len(set(self.loggers)) < len(self.loggers):
            raise invalid("run.loggers", list(self.loggers),
                           'must list "jsonl" (always written: the reports read it) '
                           "and no logger twice")


AUTOPILOT_KEYS = ("rollout.max_inflight_prompts", "queue.max_groups",
                  "trainer.micro_batch_tokens", "staleness.max_staleness")
"""autopilot.keys by default: every live key (``async_rl.knobs.LIVE_KEYS``, which this
module cannot import; a test holds the two equal)."""


class AutopilotConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The same decisions a tuner makes, made while a run trains: every few steps one
    live key moves one rung of its ladder against the biggest measured idle cause of the
    last window, and is put back when the next window's groups/s fell by more than the
    noise (``async_rl.control.autopilot``; docs/autopilot.md)."""

    enabled: bool = False
    """Retune the run while it trains; every change goes to metrics.jsonl
    (``autopilot/<key>``), a console line, run.json and ``async-rl report``."""
    every_steps: Positive = 5
    """Decide at most this often, on the idle causes of the last window of this many
    steps (a change is judged on the window after it)."""
    keys: tuple[str, ...] = AUTOPILOT_KEYS
    """The keys it may change: live keys only (these four)."""
    max_staleness: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """The most staleness.max_staleness may reach under the autopilot (the run starts
    there); -1: staleness.max_staleness. At most staleness.max_staleness, the run's hard
    bound."""
    max_rollout_workers: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """The most rollout engines the autopilot may run: from rollout.num_workers (the run
    starts there) up to this many, engines joining and leaving while the run trains
    (docs/autopilot.md); -1: rollout.num_workers, no engine added. Each engine added
    takes rollout.cpus_per_worker cores (spare ones first, then the trainer's) or one
    GPU of the cluster's."""


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
    autopilot: AutopilotConfig = msgspec.field(default_factory=AutopilotConfig)
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
        ahead = self.staleness.max_ahead
        if 0 <= ahead < self.weights.sync_every - 1:
            raise invalid("staleness.max_ahead", ahead,
                          f"must be >= weights.sync_every - 1 ({self.weights.sync_every - 1})"
                          " or -1: the trainer would wait for groups the gate admits only"
                          " once a version it has not yet published is delivered")
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
        ceiling = self.autopilot.max_staleness
        if ceiling > self.staleness.max_staleness:
            raise invalid("autopilot.max_staleness", ceiling,
                          f"must be <= staleness.max_staleness "
                          f"({self.staleness.max_staleness}), the run's hard bound")
        if 0 <= ceiling < self.weights.sync_every - 1:
            raise invalid("autopilot.max_staleness", ceiling,
                          f"must be >= weights.sync_every - 1 ({self.weights.sync_every - 1})"
                          ": rollout runs weights that many versions old")
        self._check_engines()
        env = self.task.environment
        turns = env.enabled or self.task.kind == "agent"  # multi-turn trajectories
        if turns and self.run.eval_on == "idle_cpu":
            raise invalid("run.eval_on", self.run.eval_on,
                          'the idle-CPU evaluator generates single-turn: use "rollout" '
                          "with task.environment or an agent task")
        if self.rollout.chat_template and self.task.kind != "agent":
            raise invalid("rollout.chat_template", self.rollout.chat_template,
                          'only an agent task\'s gateway renders chats (task.kind = "agent")')
        if turns and env.max_trajectory_tokens > self.trainer.micro_batch_tokens:
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

    def _check_engines(self) -> None:
        most = self.autopilot.max_rollout_workers
        if 0 <= most < self.rollout.num_workers:
            raise invalid("autopilot.max_rollout_workers", most,
                          f"must be >= rollout.num_workers ({self.rollout.num_workers}), "
                          "or -1: no engine beyond them")
        if most > self.rollout.num_workers and self.run.colocate is not False:
            raise invalid("autopilot.max_rollout_workers", most,
                          "not with run.colocate = "
                          + ("true" if self.run.colocate is True else '"time"')
                          + ": an engine added "
                          "needs devices of its own")

    @property
    def lendable_engines(self) -> int:
        """Rollout engines the autopilot may add beyond rollout.num_workers (0 without
        ``[autopilot]``)."""
        if not self.autopilot.enabled:
            return 0
        return max(self.autopilot.max_rollout_workers - self.rollout.num_workers, 0)

    def _check_roles(self) -> None:
        """The reference and the critic compute on the packed layout, beside the
        trainer shards (as DDP replicas) or on workers of their own."""
        trainer = self.trainer
        if trainer.kl_in_reward and not self.has_critic:
            raise invalid("trainer.kl_in_reward", True,
                          'needs algorithm.advantage = "gae" (a per-token reward needs '
                          "per-token advantages); GRPO takes the KL as a loss term")
        if not (self.has_reference or self.has_critic):
            return
        why = "the reference" if self.has_reference else "the critic"
        if not trainer.packed:
            raise invalid("trainer.packed", False,
                          f"{why} computes on the packed micro-batches: needs true")
        critic = self.critic
        if self.has_critic and critic.placement == "own" and trainer.backend != "ddp":
            raise invalid("trainer.backend", trainer.backend,
                          'a critic on workers of its own (critic.placement = "own") is '
                          'built for "ddp" only')
        if self.has_critic and critic.placement == "trainer" and (
                critic.num_shards != trainer.num_shards):
            raise invalid("critic.num_shards", critic.num_shards,
                          f'with critic.placement = "trainer" one critic shard sits beside '
                          f"each trainer shard: must equal trainer.num_shards "
                          f"({trainer.num_shards})")
        if self.has_critic and critic.placement == "own" and (
                trainer.num_shards % critic.num_shards):
            raise invalid("critic.num_shards", critic.num_shards,
                          f'with critic.placement = "own" each critic shard fits the batches '
                          f"of as many trainer shards: must divide trainer.num_shards "
                          f"({trainer.num_shards})")
        if (self.has_critic and critic.placement == "own" and trainer.kl_in_reward
                and self.reference.placement != "own"):
            raise invalid("reference.placement", self.reference.placement,
                          'with critic.placement = "own" and trainer.kl_in_reward the critic '
                          "takes the reference's logprobs from the reference's own worker: "
                          'needs "own"')
