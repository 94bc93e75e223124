"""Published sync-to-async speedups, predicted from their setups and the shipped GPU files.

verl's fully async policy README (verl/experimental/fully_async_policy/README.md,
"Asynchronous Training on 7B Model") reports, on H20s with Qwen2.5-Math-7B, DAPO on
dapo-math-17k, max_response_length 28K, rollout.n 16, 512 prompts per step,
ppo_mini_batch_size 32, colocate sync on 32, 64 and 128 GPUs against fully_async_policy
on 16:16, 32:32 and 64:64 (``PAIRS``), and on 128 GPUs a "stream off policy pipeline"
(``STREAM``): seconds per step and per phase, and the wall time after 100, 200, 300 and
400 steps, whose ratios are verl's reported speedups (its headline, "2.35x-2.67x at 128
GPUs", is the 128-GPU pair's four). Simulated here with the shipped h20 file:

- colocate sync on N GPUs as max_staleness 0 with all N GPUs rolling out and all N training
  (the two phases take turns on the same GPUs, so a step costs what it costs
  disaggregated with nothing overlapping: the time is the same, the devices are N); its
  16 updates a step make the proximal forward pass, which is verl's old_log_prob;
- fully async on N/2:N/2 as max_staleness 1 (staleness_threshold 0.5, partial rollout:
  in-flight weight updates), the parameter sync every 512 prompts, and the rollout's log
  probabilities as the old policy's (trainer.tis_cap = 0: no proximal pass, as verl's
  fully async rows have no old_log_prob);
- the stream off policy pipeline on 64:64 (staleness_threshold 0, no partial rollout) as
  the fully async run with max_staleness 0 (a step's rollouts are all made by its own
  version) and drain weight updates. verl's trainer starts a step on every 128 prompts
  (require_batches 4 x 32), 4 steps a weight version; the simulated one waits for the
  step's 512, so this row overlaps less than verl's. ``--stream-steps 4`` simulates
  verl's structure instead: 4 steps of 128 a version (weights.sync_every 4,
  max_staleness 3);
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
  capped at 28,672, the same at every step (verl's lengths drifted over its 400 steps).

Three figures the README leaves out are fitted from the pairs' phase columns, never
from their step times: the median response length, from the sync gen phases; the
trainer's MFU, from the sync old_log_prob + update_actor; and how much shorter the
async runs' responses are than the sync runs', from the async update_actor (verl's
async trainer spends about 0.55x the GPU-seconds of the sync one on each step's prompts
at every scale, which the cost model can only read as fewer tokens: the README notes
that streaming changed the response lengths). Each is fitted in that order (each depends
on the ones before) so that the geometric mean of simulated / published over the pairs
fitted on is 1: all three pairs by default (``--fit-on all``: no pair favoured), or one
(``--fit-on 32``, 64 or 128: the other pairs are then predictions). ``--fit-on each``
fits every pair's median on its own sync gen phase (verl's lengths changed from run to
run), the MFU and the async lengths jointly; the stream row takes the 128-GPU median.
It matches every gen phase by construction, but not the training: the 32-GPU median
(about 2.4x the 64-GPU one) makes that pair's training 1.6-1.8x verl's, whose 32-GPU
trainer spent fewer GPU-seconds a step than its 64-GPU one. So ``all`` stays the
default. The stream row is never fitted on.

verl's step column is 96-99% of its wall time after 400 steps / 400 on all seven rows:
its columns are means over the 400 steps. The simulated figures are means too, over the
steps after the pipeline filled (the first two; a 400-step run amortises its filling).

Printed: the fitted figures; per run the simulated and published seconds per step and
phase times; per comparison the predicted speedup (the ratio of the simulated mean
seconds per step) against the published step ratio and verl's four total-time ratios,
with the errors.

    python bench/sim_published.py
    python bench/sim_published.py --fit-on each
    python bench/sim_published.py --fit-on 64 --steps 8
    python bench/sim_published.py --sigma 1.35 --stream-steps 4
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import re
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
    """One row of verl's tables: seconds per step and per phase, and wall time after
    100, 200, 300 and 400 steps as the README writes it."""

    step: float
    gen: float
    train: float
    """old_log_prob + update_actor (sync), update_actor (async)."""
    totals: tuple[str, str, str, str]

    def seconds(self, column: int) -> float:
        """``totals[column]`` ("1d3h43m") in seconds."""
        match = re.fullmatch(r"(?:(\d+)d)?(?:(\d+)h)?(\d+)m", self.totals[column])
        assert match, self.totals[column]
        days, hours, minutes = (int(g or 0) for g in match.groups())
        return ((days * 24 + hours) * 60 + minutes) * 60.0


class Pair(msgspec.Struct, frozen=True, kw_only=True):
    """Colocate sync on ``gpus`` and fully async on half and half."""

    gpus: int
    sync: Published
    fully_async: Published


PAIRS = (
    Pair(gpus=32,
         sync=Published(step=790.10, gen=357.41, train=107.71 + 269.80,
                        totals=("13h44m", "1d3h43m", "2d9h22m", "3d17h5m")),
         fully_async=Published(step=294.77, gen=21.26, train=313.81,
                               totals=("7h58m", "16h21m", "1d0h53m", "1d9h26m"))),
    Pair(gpus=64,
         sync=Published(step=365.28, gen=150.72, train=70.26 + 133.41,
                        totals=("10h22m", "20h45m", "1d7h6m", "1d17h32m")),
         fully_async=Published(step=189.26, gen=28.46, train=156.98,
                               totals=("4h57m", "10h14m", "16h58m", "21h40m"))),
    Pair(gpus=128,
         sync=Published(step=356.30, gen=177.85, train=53.92 + 113.81,
                        totals=("8h36m", "17h56m", "1d5h6m", "1d16h48m")),
         fully_async=Published(step=150.63, gen=33.14, train=113.16,
                               totals=("3h13m", "6h46m", "10h53m", "17h22m"))),
)
STREAM = Published(step=231.34, gen=128.47, train=98.77,
                   totals=("4h25m", "9h41m", "15h2m", "1d1h53m"))
"""The stream off policy pipeline on 64:64, against the 128-GPU sync row."""


ROLLOUT_TP = 4
"""GPUs per rollout engine (gen_tp in verl's scripts)."""
SEQUENCE_PARALLEL = 4
"""GPUs per trainer shard (sp_size: Ulysses sequence parallel)."""
MICRO_BATCH_TOKENS = 61_440 * SEQUENCE_PARALLEL
"""A shard's micro-batch cap: ppo_max_token_len_per_gpu x sp_size (verl's dynamic batch
size counts the tokens of a sequence-parallel group)."""


class Mode(msgspec.Struct, frozen=True, kw_only=True):
    """One of verl's training modes in this project's knobs."""

    name: str
    split: bool
    """N/2 GPUs roll out and N/2 train (the fully async machinery); else N and N, taking
    turns (colocated)."""
    max_staleness: int
    inflight: int
    """rollout.max_inflight_prompts."""
    tis_cap: float
    """2.0: a proximal pass (old_log_prob); 0: the rollout's log probabilities."""
    update_mode: str
    trainer_steps: int = 1
    """Trainer steps a weight version (verl's trigger_parameter_sync_step), each of
    512 / trainer_steps prompts (require_batches x ppo_mini_batch_size)."""


SYNC = Mode(name="colocate sync", split=False, max_staleness=0, inflight=512, tis_cap=2.0,
            update_mode="in_flight")
FULLY_ASYNC = Mode(name="fully async", split=True, max_staleness=1, inflight=16,
                   tis_cap=0.0, update_mode="in_flight")
STREAMING = Mode(name="stream off policy", split=True, max_staleness=0, inflight=16,
                 tis_cap=0.0, update_mode="drain")
STREAMING_4 = Mode(name="stream off policy", split=True, max_staleness=3, inflight=16,
                   tis_cap=0.0, update_mode="drain", trainer_steps=4)
"""``--stream-steps 4``: verl's own structure, 4 trainer steps of 128 prompts a weight
version (require_batches 4 x 32, trigger_parameter_sync_step 4); max_staleness 3 lets
each version's prompts be trained over its 4 steps, and no further."""


class Assumed(msgspec.Struct, frozen=True, kw_only=True):
    """The figures the README leaves out (fitted by ``fit``)."""

    median: float = 1000.0
    """Median sync response, tokens."""
    sigma: float = 0.9
    """Of log(response length); a group's samples share half of it."""
    train_mfu: float = 0.35
    async_lengths: float = 1.0
    """The fully async machinery's response lengths as a fraction of the sync run's."""


class Phases(msgspec.Struct, frozen=True, kw_only=True):
    """Mean simulated seconds of a step, of its wait for rollouts, of its training."""

    step: float
    wait: float
    train: float


def verl_config(mode: Mode, role: int, steps: int, median: float, sigma: float,
                out: Path) -> Config:
    """``role`` GPUs rolling out and as many training, in ``mode``."""
    return msgspec.convert({
        "model": {"path": "Qwen/Qwen2.5-Math-7B", "dtype": "bfloat16"},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"num_workers": role // ROLLOUT_TP, "group_size": 16,
                    "max_new_tokens": 28672, "max_inflight_prompts": mode.inflight,
                    "stall_timeout_s": 86400.0},
        "queue": {"max_groups": 1024, "max_tokens": 1 << 40, "bucket_edges": [65536]},
        "staleness": {"max_staleness": mode.max_staleness},
        "weights": {"update_mode": mode.update_mode, "sync_every": mode.trainer_steps},
        "trainer": {"num_shards": role // SEQUENCE_PARALLEL,
                    "groups_per_step": 512 // mode.trainer_steps,
                    "micro_batch_tokens": MICRO_BATCH_TOKENS,
                    "mini_batches": 16 // mode.trainer_steps, "tis_cap": mode.tis_cap},
        "run": {"num_steps": steps * mode.trainer_steps, "output_dir": str(out), "progress": False,
                "record_spans": False, "eval_every": 0},
        "simulate": {"hardware": "h20", "lengths": "lognormal", "length_median": median,
                     "length_sigma": sigma, "group_spread": sigma / 2,
                     "prompt_tokens": 256, "parameters": 7.6e9, "kv_bytes_per_token": 57344,
                     "attention_width": 28 * 3584},
    }, Config)


@functools.cache
def phases(gpus: int, mode: Mode, assumed: Assumed, steps: int) -> Phases:
    """Simulates ``mode`` on ``gpus``; the first two steps (the pipeline filling) are
    left out (each set of arguments is simulated once)."""
    role = gpus // 2 if mode.split else gpus
    median = assumed.median * (assumed.async_lengths if mode.split else 1.0)
    return mean_phases(lambda out: verl_config(mode, role, steps, median, assumed.sigma, out),
                       devices_per_rollout_worker=ROLLOUT_TP,
                       devices_per_trainer_shard=SEQUENCE_PARALLEL,
                       train_mfu=assumed.train_mfu, per=mode.trainer_steps)


def mean_phases(config: Callable[[Path], Config], per: int = 1, **hardware: float) -> Phases:
    """Simulates ``config(run directory)`` on its hardware file with ``hardware``'s fields
    replaced; the means over the steps after the first two (the pipeline filling), of
    ``per`` steps together (one published step)."""
    with tempfile.TemporaryDirectory() as out:
        run = config(Path(out))
        shipped = simulation_costs(run)
        simulate(run, Costs(msgspec.structs.replace(shipped.hardware, **hardware),
                            shipped.model))
        rows = read_metrics(Path(out))[2 * per:]
    assert rows, "simulate more than two steps"
    return Phases(
        step=per * statistics.fmean(r["wait_s"] + r["train_s"] + r["sync_s"] for r in rows),
        wait=per * statistics.fmean(r["wait_s"] for r in rows),
        train=per * statistics.fmean(r["train_s"] for r in rows))


def scale(value: float, targets: Sequence[float],
           measure: Callable[[float], Sequence[float]], power: float) -> float:
    """``value`` adjusted until the geometric mean of ``measure(value)`` / ``targets`` is
    within 1% of 1, assuming every measure grows about as ``value ** power`` (for one
    target: that target met; for several, the least squares of the log ratios)."""
    for _ in range(8):
        error = statistics.fmean(math.log(got / target)
                                 for got, target in zip(measure(value), targets, strict=True))
        if abs(error) < 0.01:
            break
        value *= math.exp(-error / power)
    return value


def fit(pairs: Sequence[Pair], steps: int, sigma: float, each: bool) -> dict[int, Assumed]:
    """Per pair's GPUs, its figures: the median length from the sync gen phases of
    ``pairs`` (with ``each``, every pair's from its own), the MFU from the sync training,
    the async lengths from the async training, in that order (each depends on the ones
    before; the last two are one figure for every pair)."""
    base = Assumed(sigma=sigma)

    def median(group: Sequence[Pair]) -> Assumed:
        return msgspec.structs.replace(base, median=scale(
            base.median, [p.sync.gen for p in group], lambda m: [
                phases(p.gpus, SYNC, msgspec.structs.replace(base, median=m), steps).wait
                for p in group], 1.0))

    if each:
        assumed = {p.gpus: median([p]) for p in PAIRS}
    else:
        assumed = dict.fromkeys((p.gpus for p in PAIRS), median(pairs))

    def refit(field: str, mode: Mode, published: Callable[[Pair], Published],
              start: float, power: float) -> None:
        value = scale(start, [published(p).train for p in pairs], lambda v: [
            phases(p.gpus, mode, msgspec.structs.replace(assumed[p.gpus], **{field: v}),
                   steps).train for p in pairs], power)
        for gpus, figures in assumed.items():
            assumed[gpus] = msgspec.structs.replace(figures, **{field: value})

    refit("train_mfu", SYNC, lambda p: p.sync, base.train_mfu, -1.0)
    refit("async_lengths", FULLY_ASYNC, lambda p: p.fully_async, 1.0, 1.0)
    return assumed


def _versus(predicted: float, published: float) -> str:
    return f"{published:.2f}x ({predicted / published - 1:+.0%})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fit-on", default="all",
                        choices=["all", "each", *(str(p.gpus) for p in PAIRS)],
                        help="the pairs (sync GPUs) whose phase times fit the assumptions; "
                             "each: all three, every pair's median on its own sync gen phase")
    parser.add_argument("--sigma", type=float, default=0.9,
                        help="assumed spread of log(response length)")
    parser.add_argument("--stream-steps", type=int, choices=[1, 4], default=1,
                        help="trainer steps a version in the stream row: 1, a step of 512 "
                             "prompts; 4, verl's 4 steps of 128")
    args = parser.parse_args(argv)
    logging.getLogger("async_rl").setLevel(logging.WARNING)
    fitted_on = [p for p in PAIRS if args.fit_on in ("all", "each", str(p.gpus))]
    assumed = fit(fitted_on, args.steps, args.sigma, args.fit_on == "each")
    on = {"all": "all three pairs", "each": "all three pairs, each its own median"}.get(
        args.fit_on, f"the {args.fit_on}-GPU pair")
    last = assumed[PAIRS[-1].gpus]
    medians = (", ".join(f"{a.median:.0f} ({gpus} GPUs)" for gpus, a in assumed.items())
               if args.fit_on == "each" else f"{last.median:.0f}")
    print(f"fitted on {on}: median sync response {medians} tokens (sigma {last.sigma}), "
          f"train_mfu {last.train_mfu:.3f}, "
          f"async responses {last.async_lengths:.2f}x the sync ones\n")
    runs = [(p.gpus, SYNC, p.sync) for p in PAIRS]
    runs += [(p.gpus, FULLY_ASYNC, p.fully_async) for p in PAIRS]
    streaming = STREAMING_4 if args.stream_steps == 4 else STREAMING
    runs.append((PAIRS[-1].gpus, streaming, STREAM))
    print("| run | GPUs | s/step sim (published) | gen | train |")
    print("| --- | --- | --- | --- | --- |")
    for gpus, mode, published in runs:
        sim = phases(gpus, mode, assumed[gpus], args.steps)
        split = f"{gpus // 2}:{gpus // 2}" if mode.split else str(gpus)
        print(f"| {mode.name} | {split} | {sim.step:.0f} ({published.step:.0f}) "
              f"| {sim.wait:.0f} ({published.gen:.0f}) "
              f"| {sim.train:.0f} ({published.train:.0f}) |", flush=True)
    print("\n| speedup | sim | published step ratio (error) | after 100 steps | 200 | 300 "
          "| 400 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    comparisons = [(p, FULLY_ASYNC, p.fully_async) for p in PAIRS]
    comparisons.append((PAIRS[-1], streaming, STREAM))
    for pair, mode, published in comparisons:
        sync = phases(pair.gpus, SYNC, assumed[pair.gpus], args.steps)
        fast = phases(pair.gpus, mode, assumed[pair.gpus], args.steps)
        predicted = sync.step / fast.step
        totals = " | ".join(
            _versus(predicted, pair.sync.seconds(c) / published.seconds(c)) for c in range(4))
        half = pair.gpus // 2
        print(f"| {mode.name} {half}:{half} over sync {pair.gpus} | {predicted:.2f}x "
              f"| {_versus(predicted, pair.sync.step / published.step)} | {totals} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
