"""Published sync-to-async speedups, predicted from their setups and the shipped GPU files.

verl's fully async policy README (verl/experimental/fully_async_policy/README.md,
"Asynchronous Training on 7B Model") reports, on H20s with Qwen2.5-Math-7B, DAPO on
dapo-math-17k, max_response_length 28K, rollout.n 16, 512 prompts per step,
ppo_mini_batch_size 32, seconds per step and per phase of colocate sync on 32, 64 and
128 GPUs (step 790.10, 365.28, 356.30; gen 357.41, 150.72, 177.85; old_log_prob 107.71,
70.26, 53.92; update_actor 269.80, 133.41, 113.81) against fully_async_policy on 16:16,
32:32 and 64:64 (step 294.77, 189.26, 150.63; update_actor 313.81, 156.98, 113.16):
2.68x, 1.93x and 2.37x. Simulated here with the shipped h20 file:

- colocate sync on N GPUs as max_staleness 0 with all N GPUs rolling out and all N training
  (the two phases take turns on the same GPUs, so a step costs what it costs
  disaggregated with nothing overlapping: the time is the same, the devices are N); its
  16 updates a step make the proximal forward pass, which is verl's old_log_prob;
- fully async on N/2:N/2 as max_staleness 1 (staleness_threshold 0.5, partial rollout:
  in-flight weight updates), the parameter sync every 512 prompts, and the rollout's log
  probabilities as the old policy's (trainer.tis_cap = 0: no proximal pass, as verl's
  fully async rows have no old_log_prob);
- the parallelism of verl's scripts for these runs
  (verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_*.sh: gen_tp=4,
  sp_size=4, fsdp_size=8, ppo_max_token_len_per_gpu = 2 x (2K + 28K)): one engine per 4
  GPUs (tensor parallel 4, ``devices_per_rollout_worker`` 4), one trainer shard per 4
  GPUs (Ulysses sequence parallel 4: ``devices_per_trainer_shard`` 4; the shards wait
  for each other at each of the 16 optimizer updates a step, 512 / 32), micro-batches of
  at most 61,440 x 4 tokens a shard. The sync rows' script is not published; they are
  assumed to use the same parallelism;
- in flight: the sync run hands every engine its share of the 512 prompts at once; the
  async rollouter keeps at most 16 prompts per engine in flight (verl's
  fully_async_rollouter: max_concurrent_samples = 16 x the rollout servers), so
  ``rollout.max_inflight_prompts`` is 16 there; prompts of 256 tokens;
- responses log-normal with sigma 0.9 (``--sigma``; a group's samples share half of it),
  capped at 28,672.

Three figures the README leaves out are fitted on one published pair (``--fit-on``, the
32-GPU one by default) from its phase columns, never from its step times: the median
response length, so that the simulated sync gen phase takes the published time; the
trainer's MFU, so that the sync old_log_prob + update_actor do; and how much shorter the
async run's responses are than the sync run's, so that the async update_actor does
(verl's async trainer spends about 0.55x the GPU-seconds of the sync one on each step's
prompts at every scale, which the cost model can only read as fewer tokens: the README
notes that streaming changed the response lengths). The other pairs are predictions.
Fitted on the 32-GPU pair, the training MFU comes out near 0.93, which no FSDP run
reaches: that pair's gen phase (357 s, 2.4x the 64-GPU one on half the GPUs) cannot be
matched with the others' by one length law, so compare ``--fit-on 64`` and
``--fit-on 128``, whose fitted figures are plausible.

Printed: the fitted figures, then per pair the simulated and published seconds per step
(the median over the steps after the pipeline filled) and phase times, the predicted
and published speedups, and the error.

    python bench/sim_published.py
    python bench/sim_published.py --fit-on 64 --steps 8
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from async_rl.config import Config
from async_rl.run.run_dir import read_metrics
from async_rl.sim.costs import Costs
from async_rl.sim.run import simulate, simulation_costs


class Published(msgspec.Struct, frozen=True, kw_only=True):
    """One row pair of verl's table: colocate sync on ``gpus`` and fully async on half
    and half; seconds per step and per phase."""

    gpus: int
    sync_step: float
    sync_gen: float
    sync_train: float
    """old_log_prob + update_actor."""
    async_step: float
    async_train: float
    """update_actor."""


PUBLISHED = (
    Published(gpus=32, sync_step=790.10, sync_gen=357.41, sync_train=107.71 + 269.80,
              async_step=294.77, async_train=313.81),
    Published(gpus=64, sync_step=365.28, sync_gen=150.72, sync_train=70.26 + 133.41,
              async_step=189.26, async_train=156.98),
    Published(gpus=128, sync_step=356.30, sync_gen=177.85, sync_train=53.92 + 113.81,
              async_step=150.63, async_train=113.16),
)


ROLLOUT_TP = 4
"""GPUs per rollout engine (gen_tp in verl's scripts)."""
SEQUENCE_PARALLEL = 4
"""GPUs per trainer shard (sp_size: Ulysses sequence parallel)."""
MICRO_BATCH_TOKENS = 61_440 * SEQUENCE_PARALLEL
"""A shard's micro-batch cap: ppo_max_token_len_per_gpu x sp_size (verl's dynamic batch
size counts the tokens of a sequence-parallel group)."""
ASYNC_INFLIGHT = 16
"""Prompts each engine of the async rollouter generates at once."""


class Assumed(msgspec.Struct, frozen=True, kw_only=True):
    """The figures the README leaves out (fitted by ``fit``)."""

    median: float = 1000.0
    """Median sync response, tokens."""
    sigma: float = 0.9
    """Of log(response length); a group's samples share half of it."""
    train_mfu: float = 0.35
    async_lengths: float = 1.0
    """The async run's response lengths as a fraction of the sync run's."""


class Phases(msgspec.Struct, frozen=True, kw_only=True):
    """Median simulated seconds of a step, of its wait for rollouts, of its training."""

    step: float
    wait: float
    train: float


def verl_config(rollout: int, trainer: int, max_staleness: int, steps: int, median: float,
                sigma: float, out: Path) -> Config:
    """``rollout`` engines and ``trainer`` shards; sync (max_staleness 0) hands out every
    prompt at once, async keeps ``ASYNC_INFLIGHT`` per engine."""
    inflight = 512 if max_staleness == 0 else ASYNC_INFLIGHT
    return msgspec.convert({
        "model": {"path": "Qwen/Qwen2.5-Math-7B", "dtype": "bfloat16"},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"num_workers": rollout, "group_size": 16, "max_new_tokens": 28672,
                    "max_inflight_prompts": inflight, "stall_timeout_s": 86400.0},
        "queue": {"max_groups": 1024, "max_tokens": 1 << 40, "bucket_edges": [65536]},
        "staleness": {"max_staleness": max_staleness},
        "trainer": {"num_shards": trainer, "groups_per_step": 512,
                    "micro_batch_tokens": MICRO_BATCH_TOKENS, "mini_batches": 16,
                    "tis_cap": 2.0 if max_staleness == 0 else 0.0},
        "run": {"num_steps": steps, "output_dir": str(out), "progress": False,
                "record_spans": False, "eval_every": 0},
        "simulate": {"hardware": "h20", "lengths": "lognormal", "length_median": median,
                     "length_sigma": sigma, "group_spread": sigma / 2,
                     "prompt_tokens": 256, "parameters": 7.6e9, "kv_bytes_per_token": 57344},
    }, Config)


def phases(gpus: int, synchronous: bool, assumed: Assumed, steps: int) -> Phases:
    """Simulates sync on ``gpus`` or async on half and half; the first two steps (the
    pipeline filling) are left out of the medians."""
    role = gpus if synchronous else gpus // 2
    median = assumed.median * (1.0 if synchronous else assumed.async_lengths)
    with tempfile.TemporaryDirectory() as out:
        config = verl_config(role // ROLLOUT_TP, role // SEQUENCE_PARALLEL,
                             0 if synchronous else 1, steps, median, assumed.sigma, Path(out))
        shipped = simulation_costs(config)
        hardware = msgspec.structs.replace(
            shipped.hardware, devices_per_rollout_worker=ROLLOUT_TP,
            devices_per_trainer_shard=SEQUENCE_PARALLEL, train_mfu=assumed.train_mfu)
        simulate(config, Costs(hardware, shipped.model))
        rows = read_metrics(Path(out))[2:]
    assert rows, "simulate more than two steps"
    return Phases(step=statistics.median(r["wait_s"] + r["train_s"] + r["sync_s"]
                                         for r in rows),
                  wait=statistics.median(r["wait_s"] for r in rows),
                  train=statistics.median(r["train_s"] for r in rows))


def _scale(value: float, target: float, measure: Callable[[float], float],
           power: float) -> float:
    """``value`` adjusted until ``measure(value)`` is within 1% of ``target``, assuming
    the measure grows about as ``value ** power``."""
    for _ in range(8):
        got = measure(value)
        if abs(got / target - 1) < 0.01:
            break
        value *= (target / got) ** (1 / power)
    return value


def fit(row: Published, steps: int, sigma: float) -> Assumed:
    """The median length from the sync gen phase, the MFU from the sync training, the
    async lengths from the async training, in that order (each depends on the ones
    before)."""
    assumed = Assumed(sigma=sigma)
    median = _scale(assumed.median, row.sync_gen, lambda m: phases(
        row.gpus, True, msgspec.structs.replace(assumed, median=m), steps).wait, 1.0)
    assumed = msgspec.structs.replace(assumed, median=median)
    mfu = _scale(assumed.train_mfu, row.sync_train, lambda u: phases(
        row.gpus, True, msgspec.structs.replace(assumed, train_mfu=u), steps).train, -1.0)
    assumed = msgspec.structs.replace(assumed, train_mfu=mfu)
    shorter = _scale(1.0, row.async_train, lambda r: phases(
        row.gpus, False, msgspec.structs.replace(assumed, async_lengths=r), steps).train,
        1.0)
    return msgspec.structs.replace(assumed, async_lengths=shorter)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fit-on", type=int, default=32, choices=[p.gpus for p in PUBLISHED],
                        help="the pair (sync GPUs) whose phase times fit the assumptions")
    parser.add_argument("--sigma", type=float, default=0.9,
                        help="assumed spread of log(response length)")
    args = parser.parse_args(argv)
    logging.getLogger("async_rl").setLevel(logging.WARNING)
    assumed = fit(next(p for p in PUBLISHED if p.gpus == args.fit_on), args.steps, args.sigma)
    print(f"fitted on the {args.fit_on}-GPU pair: median sync response "
          f"{assumed.median:.0f} tokens (sigma {assumed.sigma}), "
          f"train_mfu {assumed.train_mfu:.3f}, "
          f"async responses {assumed.async_lengths:.2f}x the sync ones\n")
    print("| GPUs | sync s/step sim (published) | gen | train | async split "
          "| async s/step sim (published) | train | speedup sim | published | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in PUBLISHED:
        sync = phases(row.gpus, True, assumed, args.steps)
        fast = phases(row.gpus, False, assumed, args.steps)
        predicted, published = sync.step / fast.step, row.sync_step / row.async_step
        half = row.gpus // 2
        fitted = " (fitted)" if row.gpus == args.fit_on else ""
        print(f"| {row.gpus}{fitted} | {sync.step:.0f} ({row.sync_step:.0f}) "
              f"| {sync.wait:.0f} ({row.sync_gen:.0f}) | {sync.train:.0f} "
              f"({row.sync_train:.0f}) | {half}:{half} | {fast.step:.0f} "
              f"({row.async_step:.0f}) | {fast.train:.0f} ({row.async_train:.0f}) "
              f"| {predicted:.2f}x | {published:.2f}x | {predicted / published - 1:+.0%} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
