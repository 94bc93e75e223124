"""Published sync-vs-async comparisons the simulator was never developed against.

The validation set, chosen before any prediction was run (and not changed after):
NeMo RL's performance summary (NVIDIA-NeMo/RL, docs/about/performance-summary.md,
"Nemo RL v0.4", GRPO on OpenMathInstruct-2, DGX-H100, BF16, Megatron-core training),
which lists each model's on-policy run (generation and training colocated, taking turns
on the same GPUs) beside its 1-step off-policy run (generation on GPUs of its own), with
the total step time of each (``COMPARISONS``):

- Llama 3.1 8B Instruct, 16 GPUs on-policy against 16 GPUs 1-step off: 97.7 s, 74.6 s;
- Qwen3-32B, 32 GPUs against 64: 393 s, 215 s;
- Qwen3-30B-A3B (mixture of experts, 3.3B active), 32 GPUs against 32: 225 s, 244 s;
- Qwen3-235B-A22B (mixture of experts, 22B active), 128 GPUs against 256: 506 s, 241 s.

Its DeepSeek V3 row is left out (multi-head latent attention, whose KV bytes and FLOPs
the cost model does not describe).

A second system, added (and committed with its setup and assumptions) before any of its
predictions was run: verl's one-step-off-policy recipe (volcengine/verl,
``recipe/one_step_off_policy/README.md``, "Experimental Results", by Meituan's authors:
a table of its own, not the fully async policy README that ``bench/sim_published.py``
(at commit 43bb87e) was developed on). Qwen2.5-Math-7B, DAPO on dapo-math-17k, 2 nodes of
8 H20s (16 GPUs): colocate sync (the hybrid engine: every GPU generates, then every GPU
trains) against one-step-overlap async (4 GPUs generate, 12 train, the next step's
rollout beside this step's training), with the mean step time of each (``VERL_ONE_STEP_OFF``):

- FSDP2 trainer: 749 s sync, 520 s async;
- Megatron trainer: 699 s sync, 566 s async.

Setup, from the README and the recipe's scripts (``dapo_7b_math_fsdp2_colocate.sh``,
``dapo_7b_math_fsdp2_4_12.sh``, ``dapo_7b_math_megatron_colocate.sh``,
``dapo_7b_math_megatron_4_12.sh``): 512 prompts a step, 16 samples each in the sync
scripts and 12 in the async ones, mini-batches of 32 prompts (16 optimizer updates a
step, so a proximal pass: the tables' old_log_prob column), the maximum response of the
README (FSDP2 20,480 tokens; Megatron 8,192), generation tensor parallel 4 (FSDP2 sync)
or 2 (the others), trainer shards of 4 GPUs (FSDP2: Ulysses sequence parallel 4;
Megatron: TP 2 x PP 2), vLLM's gpu_memory_utilization 0.8 with the H20's 96 GB (the
KV-cache bound), the h20 file. The sync run hands every engine its share of the step's
prompts at once; the async run its whole batch to its 2 engines; no partial rollout
(drain updates); the weights by NCCL broadcast (the collective).

Assumed where the sources are silent, fixed before running: responses log-normal with
the length law of this model and dataset that ``bench/sim_published.py`` (at commit
43bb87e) fitted on verl's fully async table (development data, not this table):
median 1,182 tokens, sigma 0.9, a group's samples sharing half of it; 256-token prompts;
micro-batches of 81,920 tokens a shard (the FSDP2 scripts' ppo_max_token_len_per_gpu x
sequence parallel); the sync runs as time-shared devices at max_staleness 0 with no fixed cost
for an engine's release and reload (the scripts offload the trainer's parameters and
optimizer in the sync runs: not modelled), the async runs at max_staleness 1; the h20
file's efficiencies and overheads unchanged. Nothing is fitted.

Setup, from the table and the performance recipes it names
(examples/configs/recipes/llm/performance/): prompts and samples per step (64 x 32, the
235B's 16 x 32), the train global batch of 512 (so 4 optimizer updates a step, 1 for
the 235B), the maximum sequence length (4,096; 8,192), the generation tensor parallelism
and the training TP x CP x PP of each row (the devices of one engine and of one trainer
shard; data parallel shards make up the rest), the 1-step off runs' split (the recipes'
generation resources: half the GPUs) and in-flight weight updates where the recipe asks
for them (32B, 30B-A3B; the others drain), vLLM's gpu_memory_utilization 0.8 with the
H100's 80 GB (the KV-cache bound), each row's average generated length. Model shapes
from the models' config files (parameters, active parameters, KV bytes, attention).

Assumed where the sources are silent, the same for every row and fixed before running:
responses log-normal with sigma 0.8 (a group's samples share all but 0.3 of it) whose
mean is the row's average generated length, capped at the maximum length less a
128-token prompt; the shipped h100 file's efficiencies and overheads unchanged; an
engine's release and reload for a training step cost only the weight copy (the file's
fixed parts are 0); the on-policy runs as time-shared devices at max_staleness 0
(``run.colocate = "time"``), the 1-step off runs at max_staleness 1. Nothing is fitted.

Printed per comparison: the simulated mean step time of each run (after the pipeline
fills), the predicted and published step-time ratio (on-policy over off-policy) and the
error, then how many are within 25%.

    python -m bench.simulator.sim_published_unseen
    python -m bench.simulator.sim_published_unseen --steps 8
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec

from async_rl.analysis.results import step_split
from async_rl.config import Config
from async_rl.run.run_dir import read_metrics
from async_rl.sim.run import simulate

SIGMA = 0.8
GROUP_SPREAD = 0.3
PROMPT_TOKENS = 128
DEVICE_BYTES = 80e9
MEMORY_FRACTION = 0.8
TRAIN_BATCH = 512


class Model(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    parameters: float
    active: float
    kv_bytes_per_token: int
    """2 x layers x KV heads x head dim x 2 bytes."""
    attention_width: int
    """Layers x query heads x head dim."""


LLAMA_8B = Model(name="Llama 3.1 8B", parameters=8.03e9, active=8.03e9,
                 kv_bytes_per_token=2 * 32 * 8 * 128 * 2, attention_width=32 * 32 * 128)
QWEN3_32B = Model(name="Qwen3-32B", parameters=32.8e9, active=32.8e9,
                  kv_bytes_per_token=2 * 64 * 8 * 128 * 2, attention_width=64 * 64 * 128)
QWEN3_30B_A3B = Model(name="Qwen3-30B-A3B", parameters=30.5e9, active=3.3e9,
                      kv_bytes_per_token=2 * 48 * 4 * 128 * 2, attention_width=48 * 32 * 128)
QWEN3_235B_A22B = Model(name="Qwen3-235B-A22B", parameters=235e9, active=22e9,
                        kv_bytes_per_token=2 * 94 * 4 * 128 * 2,
                        attention_width=94 * 64 * 128)


class Lengths(msgspec.Struct, frozen=True, kw_only=True):
    """A system's assumed response-length law and prompt length."""

    sigma: float
    group_spread: float
    prompt_tokens: int


NEMO_LENGTHS = Lengths(sigma=SIGMA, group_spread=GROUP_SPREAD, prompt_tokens=PROMPT_TOKENS)


class Run(msgspec.Struct, frozen=True, kw_only=True):
    """One row of a table."""

    model: Model
    gpus: int
    off_policy: bool
    generate_tp: int
    """GPUs of one engine (generation tensor parallel)."""
    train_devices: int
    """GPUs of one trainer shard (TP x CP x PP)."""
    prompts: int
    samples: int
    max_length: int
    """Of a sequence, prompt included (the response is cut at it less the prompt)."""
    mean_response: float
    in_flight: bool = False
    published_s: float
    rollout_gpus: int = 0
    """GPUs generating in the off-policy run (0: half of them)."""
    updates: int = 0
    """Optimizer updates a step (0: the samples over TRAIN_BATCH)."""
    micro_batch_tokens: int = 0
    """A shard's micro-batch cap (0: max_length)."""
    hardware: str = "h100"
    device_bytes: float = DEVICE_BYTES
    lengths: Lengths = NEMO_LENGTHS
    label: str = ""
    """What tells the row apart from another of the same model (its trainer)."""

    @property
    def name(self) -> str:
        how = "1-step off" if self.off_policy else "on-policy"
        return f"{self.model.name}{' ' + self.label if self.label else ''} {how} on {self.gpus}"

    def config(self, out: Path, steps: int) -> Config:
        generate = (self.rollout_gpus or self.gpus // 2) if self.off_policy else self.gpus
        train = self.gpus - generate if self.off_policy else self.gpus
        engines, shards = generate // self.generate_tp, train // self.train_devices
        law = self.lengths
        median = self.mean_response / math.exp(law.sigma ** 2 / 2)
        return msgspec.convert({
            "model": {"path": self.model.name, "dtype": "bfloat16"},
            "task": {"kind": "longtail", "eval_size": 0},
            "rollout": {"num_workers": engines, "group_size": self.samples,
                        "max_new_tokens": self.max_length - law.prompt_tokens,
                        "max_inflight_prompts": math.ceil(self.prompts / engines),
                        "memory_fraction": MEMORY_FRACTION, "stall_timeout_s": 86400.0},
            "queue": {"max_groups": 4 * self.prompts, "max_tokens": 1 << 40,
                      "bucket_edges": [1 << 20, 1 << 30]},
            "staleness": {"max_staleness": 1 if self.off_policy else 0},
            "trainer": {"num_shards": shards, "groups_per_step": self.prompts,
                        "mini_batches": (self.updates
                                         or self.prompts * self.samples // TRAIN_BATCH),
                        "micro_batch_tokens": self.micro_batch_tokens or self.max_length},
            "weights": {"update_mode": "in_flight" if self.in_flight else "drain"},
            "run": {"num_steps": steps, "output_dir": str(out), "progress": False,
                    "record_spans": False, "eval_every": 0,
                    "colocate": False if self.off_policy else "time"},
            "simulate": {
                "hardware": self.hardware, "lengths": "lognormal", "length_median": median,
                "length_sigma": law.sigma, "group_spread": law.group_spread,
                "prompt_tokens": law.prompt_tokens, "parameters": self.model.parameters,
                "active_parameters": self.model.active,
                "kv_bytes_per_token": self.model.kv_bytes_per_token,
                "attention_width": self.model.attention_width,
                "hardware_overrides": {"devices_per_rollout_worker": self.generate_tp,
                                       "devices_per_trainer_shard": self.train_devices,
                                       "device_memory": self.device_bytes}},
        }, Config)


def pair(model: Model, *, on: tuple[int, int, int, float, float],
         off: tuple[int, int, int, float, float], prompts: int = 64, max_length: int = 4096,
         in_flight: bool = False) -> tuple[Run, Run]:
    """(gpus, generation TP, training devices per shard, average generated length,
    published step seconds) of the on-policy and the 1-step off row."""
    runs = []
    for (gpus, tp, train, mean, seconds), off_policy in ((on, False), (off, True)):
        runs.append(Run(model=model, gpus=gpus, off_policy=off_policy, generate_tp=tp,
                        train_devices=train, prompts=prompts, samples=32,
                        max_length=max_length, mean_response=mean,
                        in_flight=in_flight and off_policy, published_s=seconds))
    return runs[0], runs[1]


COMPARISONS = (
    # Training [TP, CP, EP, PP]: 8B [1,1,1,2]; 32B [4,1,1,4]; 30B-A3B [2,1,8,1] then
    # [1,1,8,2]; 235B [2,2,16,8] then [4,1,16,8]: TP x CP x PP devices a shard.
    pair(LLAMA_8B, on=(16, 1, 2, 1060, 97.7), off=(16, 1, 2, 1129, 74.6)),
    pair(QWEN3_32B, on=(32, 4, 16, 3206, 393.0), off=(64, 4, 16, 3207, 215.0),
         in_flight=True),
    pair(QWEN3_30B_A3B, on=(32, 4, 2, 3154, 225.0), off=(32, 2, 2, 3158, 244.0),
         in_flight=True),
    pair(QWEN3_235B_A22B, on=(128, 16, 32, 5671, 506.0), off=(256, 8, 32, 5691, 241.0),
         prompts=16, max_length=8192),
)


QWEN25_MATH_7B = Model(name="Qwen2.5-Math-7B", parameters=7.6e9, active=7.6e9,
                       kv_bytes_per_token=57344, attention_width=28 * 3584)
VERL_LENGTHS = Lengths(sigma=0.9, group_spread=0.45, prompt_tokens=256)
VERL_MEDIAN = 1182.0
"""The length law ``bench/sim_published.py`` (at commit 43bb87e) fitted for this model and
dataset (development data)."""


def verl_pair(label: str, *, sync: tuple[int, float], off: tuple[int, float],
              max_response: int) -> tuple[Run, Run]:
    """(generation TP, published step seconds) of the colocate sync run on 16 H20s and of
    the one-step-off run on 4 + 12."""
    mean = VERL_MEDIAN * math.exp(VERL_LENGTHS.sigma ** 2 / 2)
    common = {"model": QWEN25_MATH_7B, "gpus": 16, "train_devices": 4, "prompts": 512,
              "max_length": max_response + VERL_LENGTHS.prompt_tokens,
              "mean_response": mean, "updates": 16, "micro_batch_tokens": 81920,
              "hardware": "h20", "device_bytes": 96e9, "lengths": VERL_LENGTHS,
              "label": label}
    return (Run(off_policy=False, generate_tp=sync[0], samples=16, published_s=sync[1],
                **common),  # type: ignore[arg-type]
            Run(off_policy=True, generate_tp=off[0], samples=12, published_s=off[1],
                rollout_gpus=4, **common))  # type: ignore[arg-type]


VERL_ONE_STEP_OFF = (
    verl_pair("FSDP2", sync=(4, 749.0), off=(2, 520.0), max_response=20480),
    verl_pair("Megatron", sync=(2, 699.0), off=(2, 566.0), max_response=8192),
)
SYSTEMS = {"NeMo RL v0.4": COMPARISONS, "verl one-step-off": VERL_ONE_STEP_OFF}


def step_seconds(run: Run, steps: int) -> float:
    """The simulated mean step time after the pipeline fills."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "run"
        simulate(run.config(out, steps))
        split = step_split(read_metrics(out), 1 if run.off_policy else 0)
    assert split is not None
    return split.step_s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    logging.getLogger("async_rl").setLevel(logging.WARNING)
    print("| comparison | on-policy s (published) | 1-step off s (published) | predicted "
          "ratio | published ratio | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    within = total = 0
    for system, comparisons in SYSTEMS.items():
        for on, off in comparisons:
            slow, fast = step_seconds(on, args.steps), step_seconds(off, args.steps)
            predicted, published = slow / fast, on.published_s / off.published_s
            error = predicted / published - 1
            within += abs(error) <= 0.25
            total += 1
            print(f"| {system}: {on.name} vs {off.gpus} | {slow:.1f} ({on.published_s:g}) "
                  f"| {fast:.1f} ({off.published_s:g}) | {predicted:.2f} | {published:.2f} "
                  f"| {100 * error:+.0f}% |", flush=True)
    print(f"within 25%: {within} of {total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
