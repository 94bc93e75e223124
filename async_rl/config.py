"""The run configuration: one tree of frozen Structs decoded from TOML.

Owns: every knob a user can set, its default, its bounds (``msgspec.Meta``) and the rules
that tie fields together (``__post_init__``), raising ``ConfigError`` with one line that
names the key. Reading a config from TOML with ``--set`` overrides, and writing one
back, is ``async_rl.config_io``'s. Knows nothing about what the knobs drive.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Literal

import msgspec

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
AdvantageStd = Literal["sample", "population", "none"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


class ConfigError(Exception):
    """A bad config or override; ``str(err)`` is the one line shown to the user."""


def _invalid(key: str, value: object, allowed: str) -> ValueError:
    # msgspec re-raises ValueErrors from __post_init__ as ValidationError with this text.
    return ValueError(f"{key} = {value!r}: {allowed}")


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which policy to train."""

    path: str
    """Directory of a Hugging Face-format causal LM and its tokenizer (`async-rl make-model`)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype in the rollout engine and the trainer."""


class TaskConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where prompts come from and how completions are scored."""

    kind: Literal["arithmetic", "longtail", "jsonl"] = "arithmetic"
    """Built-in seeded arithmetic task (answers of a few tokens), the built-in long-tail
    reasoning task (remainders by repeated subtraction: traces of 20 to 300 tokens), or a
    JSONL file of {"prompt", "answer"} lines."""
    jsonl_path: str = ""
    """The JSONL prompt file; required when kind = "jsonl"."""
    seed: NonNegative = 0
    """Seed of the prompt stream (the arithmetic task is a pure function of seed and index)."""
    eval_size: NonNegative = 200
    """Held-out prompts scored greedily at the start and end of a run, and every
    run.eval_every steps (0 = no evaluation)."""

    def __post_init__(self) -> None:
        if self.kind == "jsonl" and not self.jsonl_path:
            raise _invalid("task.jsonl_path", self.jsonl_path, 'required when task.kind = "jsonl"')


class RolloutConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The vLLM rollout workers."""

    num_workers: Positive = 1
    """Rollout workers (one vLLM engine each)."""
    group_size: Annotated[int, msgspec.Meta(ge=2)] = 8
    """Samples per prompt; GRPO normalises rewards within this group (needs >= 2)."""
    max_new_tokens: Positive = 8
    """Completion length cap per sample."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature of the behaviour policy (the trainer scores at the same one).

    No top-p/top-k: the trainer must be able to recompute the sampled distribution."""
    max_inflight_prompts: Positive = 16
    """Prompts a worker generates at once (each expands to group_size requests)."""
    memory_fraction: Fraction = 0.2
    """vLLM gpu_memory_utilization (on CPU: the share of RAM for the KV cache)."""
    cpus_per_worker: Positive = 1
    """Cores each rollout worker owns (vLLM OMP threads)."""
    max_restarts: NonNegative = 3
    """Rollout workers started again, in all, after one dies or breaks (each from the
    trainer's current weights); past it the run stops with a checkpoint, exit status 1."""
    sampling_seed: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """-1: samples come from each engine's own random stream. >= 0: every sample request
    gets its own seed, made from this value, the prompt id, its attempt and the sample's
    index, so a prompt's samples do not depend on which worker ran it, what ran beside
    it, or a stop and resume: reproducible runs (at a small sampling cost)."""
    generate_timeout_s: PositiveFloat = 600.0
    """Longest one group's generation may take; past it the worker counts as stuck and is
    replaced like a dead one (``max_restarts``), its prompt run again."""
    stall_timeout_s: PositiveFloat = 900.0
    """Longest the run may go with no group generated and no step trained: past it the
    run stops as a rollout stall (checkpoint, one line, exit 1) instead of hanging."""
    prefix_caching: bool = False
    """vLLM prefix caching. With it, an in-flight update clears the cache, so running
    requests recompute their KV under the new weights; without it they keep the old KV
    (PipelineRL's choice) and an update pauses the engine for less time."""


class QueueConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The token-length-bucketed replay queue between rollout and training."""

    max_groups: Positive = 64
    """Capacity in groups; a full queue makes rollout wait (backpressure)."""
    max_tokens: Positive = 1_000_000
    """Capacity in tokens (prompt + completion over all samples)."""
    bucket_edges: tuple[Positive, ...] = (64, 128, 256)
    """Increasing upper edges of the token-count buckets; larger groups go in a last bucket."""
    homogeneous_take: bool = False
    """Take a step's groups from one token-length bucket (then its neighbours) to cut
    padding; the oldest group, and any that would go stale next step, are always taken."""
    wait_for_expiring: bool = True
    """A step also waits for the groups still being generated that it must train so that
    none goes stale: those it is the last step allowed to train, and any the next steps
    could not all fit. Without it a late group is dropped when it arrives, and the late
    ones are the slowest to generate, the longest: the trained mix leans short. The
    price: the trainer waits for slow groups, and trained groups are older (mean
    staleness near max_staleness); on the long-tail task that bought zero drops at the
    same or better groups/s (README, bench/stale_drops.py). homogeneous_take picks by
    bucket among what a step need not train yet, so with it a few may still go stale."""

    def __post_init__(self) -> None:
        edges = self.bucket_edges
        for lower, upper in itertools.pairwise(edges):
            if upper <= lower:
                raise _invalid("queue.bucket_edges", edges, "must be strictly increasing")


class StalenessConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How far behind the trained policy a sample may be."""

    max_staleness: NonNegative = 2
    """Hard bound η on (trained version - oldest token version); 0 = synchronous on-policy."""


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The torch trainer shards and the GRPO loss."""

    num_shards: Positive = 1
    """Data-parallel trainer shards (DDP; gloo on CPU)."""
    groups_per_step: Positive = 8
    """Groups consumed by one training step (one policy version: mini_batches * epochs
    optimizer updates, one by default)."""
    micro_batch_tokens: Positive = 4096
    """Hard cap on the tokens in one micro-batch (first-fit-decreasing packing)."""
    lr: PositiveFloat = 1e-4
    """AdamW learning rate."""
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """AdamW weight decay."""
    max_grad_norm: PositiveFloat = 1.0
    """Gradient clipping norm."""
    clip_low: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.2
    """PPO clip: the ratio's lower bound is 1 - clip_low (the ratio is pi_theta /
    pi_proximal, or pi_theta / pi_behaviour when tis_cap = 0)."""
    clip_high: PositiveFloat = 0.28
    """PPO clip: the ratio's upper bound is 1 + clip_high (DAPO's clip-higher: a
    low-probability token may rise further than a likely one may fall)."""
    clip_ratio_c: Annotated[float, msgspec.Meta(gt=1)] = 3.0
    """Dual-clip bound c (> 1): for a negative advantage the per-token loss is at most
    -c * A, so a token whose ratio ran far above 1 cannot blow up the step (verl's
    clip_ratio_c; 3.0 is its default)."""
    tis_cap: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    """Cap C on the behaviour importance weight pi_proximal / pi_behaviour (decoupled
    PPO, ``async_rl.grpo``); 0 = no proximal policy: plain PPO-clip against the
    behaviour logprobs."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """What a behaviour weight above tis_cap does. truncate: it counts as tis_cap (TIS;
    every token keeps a gradient, the default since a rare far-off token still teaches);
    mask: the token contributes nothing (AReaL's default; its tokens still count in the
    normaliser)."""
    mini_batches: Positive = 1
    """Optimizer updates per pass over a step's data: the step's groups are cut into
    this many consecutive mini-batches of whole groups (must divide groups_per_step),
    each one update. 1 = one update per step (the default: the cheapest, no proximal
    forward pass)."""
    epochs: Positive = 1
    """Passes over a step's mini-batches (each mini-batch is an update in every pass).
    With mini_batches * epochs > 1 the proximal logprobs come from one extra no-grad
    forward at step start, and the PPO clip bounds how far the later updates move."""
    advantage_std: AdvantageStd = "sample"
    """How group rewards are scaled: (r - mean) / (std + eps) with the sample std (n - 1,
    as verl, AReaL and TRL), the population std (n), or "none": r - mean (Dr. GRPO: no
    scaling, so groups with a small reward spread are not amplified)."""
    loss_agg: LossAgg = "token_mean"
    """How per-token losses become the update's loss (verl's modes). token_mean: sum over
    every token / tokens of the update (the default: every token weighs the same, long
    answers are not down-weighted; DAPO). seq_mean_token_mean: each sequence's token mean,
    averaged over sequences (the original GRPO). seq_mean_token_sum_norm: each sequence's
    token sum / rollout.max_new_tokens, averaged over sequences (Dr. GRPO). Every count
    is global: all micro-batches and all shards of the update."""
    cost_a: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """Balancing cost per token (cost = a*L + b*L^2)."""
    cost_b: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Balancing cost per squared token (attention's quadratic term)."""
    cpus_per_shard: Positive = 1
    """Cores each trainer shard owns (torch threads)."""
    step_timeout_s: PositiveFloat = 900.0
    """Longest one shard's optimizer step may take; past it the shard counts as stuck
    and the run stops with a checkpoint from a live shard (if any)."""
    max_nonfinite_steps: Positive = 3
    """Steps in a row with a non-finite gradient (each trains nothing and runs its
    prompts again) before the run stops with a checkpoint: a diverged run is loud."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Precision of the trainer's matmuls (torch autocast over forward and backward).
    Weights, gradients, optimizer state and the loss stay in model.dtype. bfloat16 makes
    a CPU step with AVX-512 bf16 about 1.5-2x faster, at the price of logprobs that
    differ from the engine's by bf16 rounding (the truncated IS weight absorbs it)."""

    def __post_init__(self) -> None:
        if self.groups_per_step % self.num_shards:
            raise _invalid(
                "trainer.groups_per_step",
                self.groups_per_step,
                f"must be a multiple of trainer.num_shards ({self.num_shards})",
            )
        if self.groups_per_step % self.mini_batches:
            raise _invalid(
                "trainer.mini_batches",
                self.mini_batches,
                f"must divide trainer.groups_per_step ({self.groups_per_step}): "
                "every mini-batch holds the same number of whole groups",
            )


class WeightsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Versioned weight broadcast from the trainer to the rollout workers."""

    sync_every: Positive = 1
    """Publish new weights every this many optimizer steps."""
    update_mode: Literal["in_flight", "drain"] = "in_flight"
    """in_flight: pause (keep requests), load, resume; drain: finish running requests first."""
    transport: Literal["gloo", "nccl", "ipc"] = "gloo"
    """How the weights travel from trainer shard 0 to each rollout engine, through vLLM's
    weight-transfer API, one group per rollout worker. gloo: a torch.distributed gloo
    group over TCP, on any hardware (the CPU default). nccl: vLLM's NCCL engine (CUDA).
    ipc: vLLM's CUDA IPC engine, for a rollout engine on the trainer's own GPU (needs
    run.colocate, one rollout worker and one trainer shard)."""
    bucket_mb: Positive = 16
    """Largest message of a transfer, in MiB: tensors are packed into buckets of at most
    this size (gloo cuts larger tensors into pieces; nccl and ipc pack per buffer). On
    gloo 8-16 measured best here (bench/weight_broadcast.py): larger receive buffers come
    fresh from the kernel at every update, smaller ones cost more messages."""
    timeout_s: PositiveFloat = 300.0
    """Longest a weight update waits on one rollout worker for any one step (its pause,
    including a drain, a message, the load) before that worker counts as failed."""


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
    colocate: bool = False
    """Rollout worker i and trainer shard i share devices (one STRICT_PACK placement
    group, both roles on the same cores at full width); default is disaggregated, each
    role on its own devices. Only with layout = "split"."""
    layout: Literal["split", "shared", "auto"] = "split"
    """How disaggregated roles use the CPU cores (workers/core_share.py).
    split: each role only its own cores (rollout first, then trainer).
    shared: the rollout engine keeps its cores; a trainer shard uses its own cores plus
    the rollout workers' while no rollout worker has requests in flight (torch threads
    and affinity change before each forward, backward and optimizer phase), and only its
    own while one does. Helps when training is the bottleneck.
    auto: starts split and measures training vs generation busy time over steps 2-4;
    if training is the bottleneck it tries shared for steps 5-7 and keeps it only if
    those steps were faster. Prints one line saying what it picked and why."""
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
    reads): past it the run stops, naming the call and the wait, instead of hanging."""
    keep_checkpoints: Positive = 2
    """Checkpoints kept; older ones are removed once a new one is complete."""
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl",)
    """Where metrics go: "jsonl" (metrics.jsonl, always written: the reports read it),
    "tensorboard" (an event file in RUN_DIR/tensorboard) and "wandb" (a W&B run in
    RUN_DIR/wandb; WANDB_MODE=offline needs no network). The last two need the
    ``loggers`` extra: pip install 'async-rl[loggers]'."""

    def __post_init__(self) -> None:
        if "jsonl" not in self.loggers or len(set(self.loggers)) < len(self.loggers):
            raise _invalid("run.loggers", list(self.loggers),
                           'must list "jsonl" (always written: the reports read it) '
                           "and no logger twice")


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole run configuration."""

    model: ModelConfig
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    queue: QueueConfig = msgspec.field(default_factory=QueueConfig)
    staleness: StalenessConfig = msgspec.field(default_factory=StalenessConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        if self.queue.max_groups < self.trainer.groups_per_step:
            raise _invalid(
                "queue.max_groups",
                self.queue.max_groups,
                f"must be >= trainer.groups_per_step ({self.trainer.groups_per_step}),"
                " or a training step could never fill",
            )
        if self.weights.sync_every - 1 > self.staleness.max_staleness:
            raise _invalid(
                "weights.sync_every",
                self.weights.sync_every,
                f"must be <= staleness.max_staleness + 1 ({self.staleness.max_staleness + 1}):"
                " rollout would run weights older than the staleness bound allows",
            )
        if self.weights.transport == "ipc" and not (
                self.run.colocate and self.rollout.num_workers == 1
                and self.trainer.num_shards == 1):
            raise _invalid("weights.transport", self.weights.transport,
                           "needs run.colocate = true, rollout.num_workers = 1 and "
                           "trainer.num_shards = 1 (CUDA IPC shares the trainer's own GPU "
                           'with one engine); use "nccl" otherwise')
        if self.run.colocate and self.run.layout != "split":
            raise _invalid("run.layout", self.run.layout,
                           'must be "split" when run.colocate = true (co-located roles '
                           "already share every core)")
        if self.trainer.micro_batch_tokens < self.rollout.max_new_tokens:
            raise _invalid(
                "trainer.micro_batch_tokens",
                self.trainer.micro_batch_tokens,
                f"must be >= rollout.max_new_tokens ({self.rollout.max_new_tokens})",
            )


def check_transport(weights: WeightsConfig, *, cuda: bool) -> None:
    """Refuses a CUDA-only ``weights.transport`` when the workers have no GPU (the one
    rule that needs to know the hardware: called once the cluster is known)."""
    if weights.transport != "gloo" and not cuda:
        raise ConfigError(f"config error: weights.transport = {weights.transport!r}: needs "
                          'CUDA GPUs, and the workers have none; use "gloo" on CPU')
