"""AReaL's published sync-to-async speedups, predicted from its setups and the h100 file.

The AReaL paper ("AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning", arXiv 2505.24298; the PDF is assets/paper.pdf in inclusionAI/AReaL)
trains DeepSeek-R1-Distill-Qwen models with PPO on H800 nodes of 8 GPUs: 512 prompts a
step, 16 answers each, 4 PPO mini-batches, at most 27,648 generated tokens (its Table 3),
and, when asynchronous, three quarters of the GPUs generating (SGLang) and one quarter
training, with the staleness bound eta (at most eta versions between a trajectory's
start and the step that trains on it; eta = 0 is synchronous). Compared here
(``COMPARISONS``):

- Figure 5c, 1.5B on math: effective training throughput at eta = 0, 1, 2, 4, 8, 16 and
  unbounded, on the asynchronous system's 3:1 split; the speedup is each throughput over
  eta = 0's. The GPU count is not given; assumed 16 nodes (128 GPUs, 96:32), the 1.5B row
  of Table 1 (see below for why);
- Table 7 (appendix C.3), 1.5B on 8 GPUs (6:2 assumed, the paper's 3:1 rule), 8K context
  (7,168 generated tokens at most), 64 prompts a step: throughput at eta = 0 to 16;
- Table 1, 1.5B and 7B on math, 250 PPO steps: the training hours of "Sync. AReaL" and of
  verl (both synchronous) over AReaL's (eta = 8), on 16 and 24 nodes. The synchronous
  runs are simulated colocated: every GPU generates, then every GPU trains (the
  ``colocate sync`` of bench/sim_published.py: max_staleness 0 with N GPUs in each role).
  The 14B and 32B coding rows are not simulated: the paper gives neither their response
  lengths nor the 14B trainer's parallelism, and its 32B runs switched to vLLM.

Taken from AReaL's verl benchmark script (benchmark/verl_312a8cb/build_cmd.py): one
SGLang engine per GPU (tensor parallel 1 below 32B), the trainer in pipeline stages of 2
GPUs (1.5B) or 4 (7B): one trainer shard per 2 or 4 GPUs; SGLang's memory fraction 0.7.

Assumed where the paper is silent:

- the responses: log-normal, sigma 0.9 (a group's samples share half of it), capped at
  27,648, with a mean of 9,217 tokens, the same for 1.5B and 7B. That mean is the
  paper's own: Figure 5c's eta = 0 and eta = 8 throughputs (128.7k and 371.7k tokens/s)
  times Table 1's 1.5B hours (41.0 and 14.8) give 9,275 and 9,670 tokens per trajectory
  over 250 x 512 x 16 trajectories (close enough to read Figure 5c as the 1.5B row's
  runs); their mean less a 256-token prompt is 9,217. Nothing gives the 7B lengths.
  Table 7's: a mean of 4,500 (capped at 7,168), from DeepScaleR's 8K stage with the
  same model, whose mean response fell from about 5,500 to 3,500 tokens;
- the engines' concurrency: AReaL bounds submissions only by eta, so an engine holds what
  its KV cache fits: 0.7 of 80 GB less the fp16 weights, over 16 samples of the mean
  trajectory (12 prompts an engine for 1.5B, 4 for 7B; 24 in Table 7);
- interruptible generation as in-flight weight updates, the decoupled objective's
  proximal policy as the proximal forward pass (``trainer.tis_cap`` 2), and the h100
  file's defaults (train_mfu 0.35, decode_mfu 0.5) for H800s, whose compute and memory
  are an H100's (only NVLink is slower). Nothing is fitted by default.

With ``--calibrate``, one figure is fitted: the trainer's MFU (train_mfu), on one
published step time, AReaL's own 1.5B eta = 8 run of Table 1 (14.8 h over 250 steps,
213 s a step; Figure 5c's eta = 8 at the same setup), by ``scale`` of sim_published.
Every comparison, the 7B ones too, is then simulated at that MFU.

Printed per comparison: the simulated mean seconds per step of each run (the steps after
the first two), the predicted speedup, the published one and the error.

    python bench/sim_published_areal.py
    python bench/sim_published_areal.py --steps 8
    python bench/sim_published_areal.py --calibrate
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import msgspec
from sim_published import Phases, mean_phases, scale

from async_rl.config import Config
from async_rl.sim.costs import load_hardware

SIGMA = 0.9
PROMPT_TOKENS = 256
DEVICE_BYTES = 80e9
MEMORY_FRACTION = 0.7
UNBOUNDED = 1_000_000
"""eta = infinity."""
HARDWARE = "h100"


class Model(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    parameters: float
    kv_bytes_per_token: int
    """2 x layers x KV heads x head dim x 2 bytes."""
    attention_width: int
    """Layers x query heads x head dim."""
    pipeline: int
    """GPUs per trainer shard (pipeline stages in AReaL's scripts)."""


R1_1_5B = Model(name="1.5B", parameters=1.78e9, kv_bytes_per_token=28_672,
                attention_width=28 * 1536, pipeline=2)
R1_7B = Model(name="7B", parameters=7.62e9, kv_bytes_per_token=57_344,
              attention_width=28 * 3584, pipeline=4)


class Setup(msgspec.Struct, frozen=True, kw_only=True):
    prompts: int
    """A step's prompts (16 samples each)."""
    max_new_tokens: int
    mean_response: float
    """Tokens, before the cap (the log-normal's median is set so the capped mean is this)."""


LARGE = Setup(prompts=512, max_new_tokens=27_648, mean_response=(
    128.7e3 * 41.0 + 371.7e3 * 14.8) * 3600 / (2 * 250 * 512 * 16) - PROMPT_TOKENS)
"""Figure 5c's throughputs times Table 1's 1.5B hours, per trajectory, less the prompt."""
SMALL = Setup(prompts=64, max_new_tokens=8192 - 1024, mean_response=4500.0)
"""Table 7's 8K context; DeepScaleR's 8K stage responses (5,500 falling to 3,500)."""


class Run(msgspec.Struct, frozen=True, kw_only=True):
    """One simulated run: colocated sync on all ``gpus``, or the 3:1 split with eta."""

    setup: Setup = LARGE
    model: Model
    gpus: int
    eta: int | None
    """None: colocated sync."""

    @property
    def name(self) -> str:
        if self.eta is None:
            return f"{self.model.name} colocated sync on {self.gpus}"
        eta = "inf" if self.eta == UNBOUNDED else str(self.eta)
        return f"{self.model.name} eta {eta} on {self.gpus * 3 // 4}:{self.gpus // 4}"


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    source: str
    slow: Run
    fast: Run
    published: float
    """Reported speedup (a throughput or hours ratio)."""
    reported: str
    steps: tuple[float, float]
    """The published seconds per step of the two runs: hours x 3600 / 250, or the tokens
    of a step (512 x 16 x (prompt + mean response)) over the throughput."""


def _ablation(source: str, setup: Setup, gpus: int, eta: int, throughput: float,
              sync: float) -> Comparison:
    tokens = setup.prompts * 16 * (PROMPT_TOKENS + setup.mean_response) / 1e3
    return Comparison(source=source, slow=Run(setup=setup, model=R1_1_5B, gpus=gpus, eta=0),
                      fast=Run(setup=setup, model=R1_1_5B, gpus=gpus, eta=eta),
                      published=throughput / sync, reported=f"{throughput}k / {sync}k tok/s",
                      steps=(tokens / sync, tokens / throughput))


def _table(model: Model, gpus: int, baseline: str, hours: float, areal: float) -> Comparison:
    return Comparison(source=f"Table 1, {baseline}", slow=Run(model=model, gpus=gpus, eta=None),
                      fast=Run(model=model, gpus=gpus, eta=8), published=hours / areal,
                      reported=f"{hours} h / {areal} h",
                      steps=(hours * 3600 / 250, areal * 3600 / 250))


COMPARISONS = (
    *(_ablation("Fig. 5c", LARGE, 128, eta, t, 128.7)
      for eta, t in ((1, 269.3), (2, 356.6), (4, 356.6), (8, 371.7), (16, 382.4),
                     (UNBOUNDED, 396.8))),
    *(_ablation("Table 7", SMALL, 8, eta, t, 27.1)
      for eta, t in ((1, 47.8), (2, 47.8), (4, 49.0), (8, 51.5), (16, 52.0))),
    _table(R1_1_5B, 128, "Sync. AReaL", 41.0, 14.8),
    _table(R1_1_5B, 128, "verl", 33.6, 14.8),
    _table(R1_7B, 192, "Sync. AReaL", 57.7, 25.4),
    _table(R1_7B, 192, "verl", 52.1, 25.4),
)


def capped_mean(median: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for log X ~ N(log median, sigma)."""
    z = (math.log(cap) - math.log(median)) / sigma
    phi = statistics.NormalDist().cdf
    return median * math.exp(sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))


def median_for(mean: float, sigma: float, cap: float) -> float:
    """The median whose capped log-normal has ``mean`` (bisection on log median)."""
    low, high = 1.0, cap
    for _ in range(60):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if capped_mean(mid, sigma, cap) < mean else (low, mid)
    return math.sqrt(low * high)


def median(setup: Setup) -> float:
    return median_for(setup.mean_response, SIGMA, setup.max_new_tokens)


def inflight_prompts(run: Run) -> int:
    """Prompts an engine's KV cache holds at the mean trajectory length."""
    free = DEVICE_BYTES * MEMORY_FRACTION - 2 * run.model.parameters
    trajectory = PROMPT_TOKENS + run.setup.mean_response
    return int(free // (run.model.kv_bytes_per_token * 16 * trajectory))


def roles(run: Run) -> tuple[int, int, int]:
    """Rollout engines, trainer shards and GPUs per shard: ``pipeline`` GPUs a shard, or
    more where the shards would not divide a step's prompts (the same GPUs training)."""
    rollout = run.gpus if run.eta is None else run.gpus * 3 // 4
    train = run.gpus if run.eta is None else run.gpus // 4
    shards = max(2 ** int(math.log2(train // run.model.pipeline)), 1)
    return rollout, shards, train // shards


def areal_config(run: Run, steps: int, out: Path) -> Config:
    rollout, shards, _ = roles(run)
    setup = run.setup
    eta = 0 if run.eta is None else run.eta
    return msgspec.convert({
        "model": {"path": f"deepseek-ai/DeepSeek-R1-Distill-Qwen-{run.model.name}",
                  "dtype": "bfloat16"},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"num_workers": rollout, "group_size": 16,
                    "max_new_tokens": setup.max_new_tokens,
                    "max_inflight_prompts": inflight_prompts(run),
                    "stall_timeout_s": 86400.0},
        "queue": {"max_groups": setup.prompts * (min(eta, 32) + 2), "max_tokens": 1 << 40,
                  "bucket_edges": [65536]},
        "staleness": {"max_staleness": eta},
        "weights": {"update_mode": "in_flight"},
        "trainer": {"num_shards": shards, "groups_per_step": setup.prompts,
                    "micro_batch_tokens": 32768, "mini_batches": 4, "tis_cap": 2.0},
        "run": {"num_steps": steps, "output_dir": str(out), "progress": False,
                "record_spans": False, "eval_every": 0},
        "simulate": {"hardware": HARDWARE, "lengths": "lognormal",
                     "length_median": median(setup),
                     "length_sigma": SIGMA, "group_spread": SIGMA / 2,
                     "prompt_tokens": PROMPT_TOKENS, "parameters": run.model.parameters,
                     "kv_bytes_per_token": run.model.kv_bytes_per_token,
                     "attention_width": run.model.attention_width},
    }, Config)


@functools.cache
def phases(run: Run, steps: int, train_mfu: float) -> Phases:
    return mean_phases(lambda out: areal_config(run, steps, out),
                       devices_per_trainer_shard=roles(run)[2], train_mfu=train_mfu)


CALIBRATION = Run(model=R1_1_5B, gpus=128, eta=8)
CALIBRATION_STEP = 14.8 * 3600 / 250
"""Table 1's AReaL 1.5B hours over its 250 steps: seconds a step."""


def calibrate(steps: int) -> float:
    """The train_mfu at which ``CALIBRATION`` takes ``CALIBRATION_STEP`` a step (a
    trainer-bound step grows about as 1 / train_mfu)."""
    return scale(load_hardware(HARDWARE).train_mfu, [CALIBRATION_STEP],
                  lambda mfu: [phases(CALIBRATION, steps, mfu).step], -1.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--calibrate", action="store_true",
                        help=f"fit train_mfu on the step time of {CALIBRATION.name} "
                             f"({CALIBRATION_STEP:.0f} s, Table 1) before predicting")
    args = parser.parse_args(argv)
    logging.getLogger("async_rl").setLevel(logging.WARNING)
    if args.calibrate:
        mfu = calibrate(args.steps)
        print(f"train_mfu {mfu:.3f}, fitted: {CALIBRATION.name} at "
              f"{phases(CALIBRATION, args.steps, mfu).step:.0f} s a step against "
              f"{CALIBRATION_STEP:.0f} s")
    else:
        mfu = load_hardware(HARDWARE).train_mfu
        print(f"train_mfu {mfu} (the {HARDWARE} file's)")
    for name, setup in (("Fig. 5c, Table 1", LARGE), ("Table 7", SMALL)):
        print(f"{name}: responses of mean {setup.mean_response:.0f} tokens (median "
              f"{median(setup):.0f}, sigma {SIGMA}, cap {setup.max_new_tokens}), in flight "
              f"per engine " + ", ".join(
                  f"{inflight_prompts(Run(setup=setup, model=m, gpus=8, eta=0))} prompts "
                  f"({m.name})" for m in (R1_1_5B, R1_7B) if setup is LARGE or m is R1_1_5B))
    print()
    print("| source | slower run | s/step sim (published) | faster run "
          "| s/step sim (published) | speedup sim | published | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in COMPARISONS:
        slow, fast = phases(c.slow, args.steps, mfu), phases(c.fast, args.steps, mfu)
        predicted = slow.step / fast.step
        print(f"| {c.source} | {c.slow.name} | {slow.step:.0f} ({c.steps[0]:.0f}) "
              f"| {c.fast.name} | {fast.step:.0f} ({c.steps[1]:.0f}) "
              f"| {predicted:.2f}x | {c.published:.2f}x ({c.reported}) "
              f"| {predicted / c.published - 1:+.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
