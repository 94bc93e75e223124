"""Ablation: max_staleness x loss form on the long-tail task, at a fixed sample budget.

Trains examples/cpu_longtail.toml once per max_staleness η in {0, 1, 2, 4, 8} x loss in
{decoupled (trainer.tis_cap = 2.0: PPO clip on pi/pi_prox times the truncated weight
pi_prox/pi_behaviour), plain (tis_cap = 0: PPO clip on pi/pi_behaviour)} x seed {0, 1}
(run.seed). Every trial trains the same samples (30 steps x 8 groups x 8) and scores
greedy held-out accuracy (100 prompts) every 2 steps: the model learns most of what it
will in the first ~1000 samples, so evaluations must be dense there.

Shared settings (``SHARED``): trainer.mini_batches = 4, four PPO updates a step as in
AReaL's comparison (with one, pi/pi_prox = 1 and the decoupled clip never binds).
trainer.groups_per_step = 8 and rollout.max_inflight_prompts = 32: the task is
generation-bound, so realized staleness is about (groups in generation) / groups per
step; the example's 16/16 leaves it at ~1.3 even at η = 8, while 32 prompts x 8 samples
fill the engine's 256 sequence slots and span ~4 versions of 8 groups.

Trials run one after another, each its own `async-rl train` (async_rl.analysis.sweep's
run_trial); the two losses of an η back to back in alternating order (ABBA), the η order
reversed for the next seed, so machine noise hits both arms alike. A trial whose run
directory holds a finished run of the same resolved config is skipped: an interrupted
ablation continues where it stopped.

    python -m bench.algorithms.staleness_ablation --set model.path=runs/longtail-model
    python -m bench.algorithms.staleness_ablation --quick         # η 0 and 4, one seed, 12 steps
    python -m bench.algorithms.staleness_ablation --staleness 0 8 --seeds 0 --steps 40 --out runs/x

Evaluations run beside training, so weights change during one (at η >= 4 one takes ~7 s
and spans ~10 versions); each is charged to the middle of the versions it scored (eval
span: mean versions spanned). Outputs in --out: ablation.csv, staleness_ablation.png
(accuracy vs samples trained, left, and vs training seconds, right; colour: η; solid:
decoupled, dashed: plain; thick: mean over seeds, thin: each seed, dots: its evaluations),
the table and the verdict. Per arm, means over seeds:
- final acc [seed min, max]; acc@N: accuracy after N samples (interpolated);
- AUC samples / AUC time: mean accuracy over the sample budget / over the shortest
  trial's training seconds. Sparse, wide evaluations bias them low (a chord under a
  concave curve), so they compare arms of equal η only;
- Δ samples / Δ time: accuracy minus the smallest η's (same loss) at equal samples /
  seconds, that curve averaged over each evaluation's own span (``matched_gap``), so
  evaluation resolution biases neither side; > 0: ahead of the smallest η;
- stale mean / max: realized staleness of trained groups; drops: groups too stale;
- clip %, out of band %, KL behav (per-step means, metrics.jsonl): tokens where the PPO
  clip bound, whose pi/pi_behaviour left the clip band, and the k3 KL(behaviour ||
  current): how off-policy the data was. Near 0, the losses have nothing to correct.
The verdict picks per loss the η with the best Δ time among those with Δ samples >=
-tolerance, and compares the losses at the highest η (a gap counts only past the
tolerance with the seed ranges apart).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from async_rl.analysis.sweep import Trial, describe, run_trial
from async_rl.config_io import load_config
from async_rl.run.inputs import check_inputs
from async_rl.run.run_dir import METRICS, SUMMARY, read_summary
from async_rl.run.summary import RunSummary
from buffers.common.config import ConfigError

LOSSES = {"decoupled": "2.0", "plain": "0.0"}
"""Loss form -> trainer.tis_cap."""
SHARED = ("trainer.mini_batches=4", "trainer.groups_per_step=8",
          "rollout.max_inflight_prompts=32", "run.progress=false", "task.eval_size=100")
OFF_POLICY = ("clip_fraction", "is_out_of_band_fraction", "kl_behaviour")
GRID = 101
"""Points of the common grids that curves are averaged and integrated on."""


class TrialFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One finished trial, from its summary.json."""

    eta: int
    loss: str
    seed: int
    samples: tuple[int, ...]
    """Samples trained at each evaluation (the first is 0)."""
    wall: tuple[float, ...]
    """Training seconds at each evaluation."""
    accuracy: tuple[float, ...]
    sample_spans: tuple[tuple[float, float], ...] = ()
    """Samples trained at the oldest and newest version each evaluation scored."""
    wall_spans: tuple[tuple[float, float], ...] = ()
    """Training seconds at those versions."""
    samples_trained: int
    wall_s: float
    groups_per_s: float
    staleness_histogram: tuple[int, ...]
    dropped_stale: int
    off_policy: dict[str, float] = {}
    """Means over the steps of metrics.jsonl's ``OFF_POLICY`` figures."""
    eval_span: float = 0.0
    """Mean versions an evaluation during training spanned (version - version_min)."""

    @property
    def stale_mean(self) -> float:
        total = sum(self.staleness_histogram)
        return sum(i * n for i, n in enumerate(self.staleness_histogram)) / total if total else 0.0

    @property
    def stale_max(self) -> int:
        return max((i for i, n in enumerate(self.staleness_histogram) if n), default=0)


class ArmRow(msgspec.Struct, frozen=True, kw_only=True):
    """One arm (η, loss): figures averaged over its seeds."""

    eta: int
    loss: str
    seeds: int
    final_acc: float
    final_min: float
    final_max: float
    acc_at: tuple[float, ...]
    """Accuracy at each of the table's sample counts."""
    auc_samples: float
    auc_range: tuple[float, float]
    """The lowest and highest seed's AUC samples."""
    auc_time: float
    gap_samples: float
    """Mean matched_gap against the smallest η's trials of the same loss, per sample."""
    gap_time: float
    """The same at equal training seconds."""
    stale_mean: float
    stale_max: int
    dropped: float
    wall_s: float
    groups_per_s: float
    off_policy: dict[str, float]
    eval_span: float


def step_means(run_dir: Path) -> dict[str, float]:
    """Means over a run's steps (metrics.jsonl) of the figures that say how far off-policy
    its data was: clip_fraction (tokens the PPO clip bound), is_out_of_band_fraction
    (tokens whose pi/pi_behaviour left the clip band) and kl_behaviour (k3 KL)."""
    rows = [msgspec.json.decode(line) for line in (run_dir / METRICS).read_bytes().splitlines()
            if line.strip()]
    rows = [row for row in rows if all(key in row for key in OFF_POLICY)]
    return {key: float(np.mean([row[key] for row in rows])) if rows else 0.0
            for key in OFF_POLICY}


def figures(summary: RunSummary, eta: int, loss: str, seed: int,
            off_policy: dict[str, float] | None = None) -> TrialFigures:
    """Each evaluation charged at the middle of the versions it scored (see the module
    docstring): samples exactly (every step trains the same samples), training seconds
    interpolated between the versions whose time the evaluations recorded."""
    # Evaluations that fell due late run after training, all on the final weights: one.
    evals = sorted({(e.version, e.version_min): e for e in summary.evals}.values(),
                   key=lambda e: (e.version, e.version_min))
    per_version = summary.samples_trained / max(summary.final_version, 1)
    known = sorted({(0, 0.0), *((e.version, e.wall_s) for e in evals)})

    def wall(versions: Sequence[float]) -> list[float]:
        return [float(w) for w in at([v for v, _ in known], [w for _, w in known], versions)]

    lows, highs = [float(e.version_min) for e in evals], [float(e.version) for e in evals]
    middle = [(lo + hi) / 2 for lo, hi in zip(lows, highs, strict=True)]
    return TrialFigures(
        eta=eta, loss=loss, seed=seed, samples=tuple(round(v * per_version) for v in middle),
        wall=tuple(wall(middle)), accuracy=tuple(e.accuracy for e in evals),
        sample_spans=tuple((lo * per_version, hi * per_version)
                           for lo, hi in zip(lows, highs, strict=True)),
        wall_spans=tuple(zip(wall(lows), wall(highs), strict=True)),
        eval_span=float(np.mean([e.version - e.version_min for e in evals
                                 if e.version_min < summary.final_version] or [0])),
        samples_trained=summary.samples_trained, wall_s=summary.wall_s,
        groups_per_s=summary.groups_per_s, staleness_histogram=summary.staleness_histogram,
        dropped_stale=summary.dropped_stale, off_policy=off_policy or {})


def at(xs: Sequence[float], ys: Sequence[float],
       points: Sequence[float] | np.ndarray) -> np.ndarray:
    """The curve (xs ascending) at ``points``: linear between evaluations, flat past its ends."""
    return np.interp(np.asarray(points, float), np.asarray(xs, float), np.asarray(ys, float))


def auc(xs: Sequence[float], ys: Sequence[float], horizon: float) -> float:
    """Mean of the curve over [0, horizon] (its area divided by the horizon)."""
    values = at(xs, ys, np.linspace(0.0, horizon, GRID))
    return float((values[:-1] + values[1:]).mean() / 2) if horizon > 0 else 0.0  # trapezoids


def matched_gap(trial: TrialFigures, reference: Sequence[TrialFigures], axis: str) -> float:
    """Mean over ``trial``'s evaluations after the first of (its accuracy - the reference
    trials' accuracy averaged over the same span of samples or seconds, ``axis``): the
    reference curve measured as this trial's evaluations measured it, so sparse or wide
    evaluations bias neither side. > 0: ahead of the reference at equal samples / time."""
    spans = trial.sample_spans if axis == "samples" else trial.wall_spans
    gaps = [accuracy - float(np.mean([at(getattr(r, axis), r.accuracy, np.linspace(lo, hi, 21))
                                      for r in reference]))
            for accuracy, (lo, hi) in zip(trial.accuracy[1:], spans[1:], strict=True)]
    return float(np.mean(gaps)) if gaps else 0.0


def aggregate(trials: Sequence[TrialFigures], sample_points: Sequence[int]) -> list[ArmRow]:
    """One row per (η, loss), sorted by η then loss; AUCs over the smallest budget and
    the shortest training time among all trials, so every arm is integrated alike."""
    if not trials:
        return []
    budget = min(t.samples_trained for t in trials)
    horizon = min(t.wall[-1] for t in trials)
    rows = []
    for eta, loss in sorted({(t.eta, t.loss) for t in trials}):
        arm = [t for t in trials if (t.eta, t.loss) == (eta, loss)]
        low = min(t.eta for t in trials if t.loss == loss)
        reference = [t for t in trials if (t.eta, t.loss) == (low, loss)]
        finals = [t.accuracy[-1] for t in arm]
        rows.append(ArmRow(
            eta=eta, loss=loss, seeds=len(arm), final_acc=float(np.mean(finals)),
            final_min=min(finals), final_max=max(finals),
            acc_at=tuple(float(np.mean([at(t.samples, t.accuracy, [n])[0] for t in arm]))
                         for n in sample_points),
            auc_samples=float(np.mean(aucs := [auc(t.samples, t.accuracy, budget) for t in arm])),
            auc_range=(min(aucs), max(aucs)),
            auc_time=float(np.mean([auc(t.wall, t.accuracy, horizon) for t in arm])),
            gap_samples=float(np.mean([matched_gap(t, reference, "samples") for t in arm])),
            gap_time=float(np.mean([matched_gap(t, reference, "wall") for t in arm])),
            stale_mean=float(np.mean([t.stale_mean for t in arm])),
            stale_max=max(t.stale_max for t in arm),
            dropped=float(np.mean([t.dropped_stale for t in arm])),
            wall_s=float(np.mean([t.wall_s for t in arm])),
            groups_per_s=float(np.mean([t.groups_per_s for t in arm])),
            eval_span=float(np.mean([t.eval_span for t in arm])),
            off_policy={key: float(np.mean([t.off_policy.get(key, 0.0) for t in arm]))
                        for key in OFF_POLICY}))
    return rows


def pick_staleness(rows: Sequence[ArmRow], loss: str, tolerance: float) -> tuple[ArmRow, ArmRow]:
    """(the pick, the baseline = the smallest η): among ``loss``'s arms at most
    ``tolerance`` behind the baseline per sample (gap_samples), the one furthest ahead
    of it per second (gap_time)."""
    arms = sorted((r for r in rows if r.loss == loss), key=lambda r: r.eta)
    keep = [r for r in arms if r.gap_samples >= -tolerance]
    return max(keep or arms[:1], key=lambda r: (r.gap_time, -r.eta)), arms[0]


def verdict(rows: Sequence[ArmRow], tolerance: float) -> list[str]:
    """Plain-language conclusions computed from the rows."""
    lines = []
    for loss in [name for name in LOSSES if any(r.loss == name for r in rows)]:
        pick, base = pick_staleness(rows, loss, tolerance)
        lost = [f"{r.eta} ({r.gap_samples:+.3f})" for r in rows
                if r.loss == loss and r.gap_samples < -tolerance]
        lines.append(
            f"{loss}: pick max_staleness = {pick.eta}. Against η = {base.eta} it is "
            f"{pick.gap_time:+.3f} accuracy at equal training seconds "
            f"({pick.groups_per_s:.1f} vs {base.groups_per_s:.1f} groups/s) and "
            f"{pick.gap_samples:+.3f} at equal samples"
            + (f"; η = {', '.join(lost)} fell more than {tolerance} behind per sample"
               if lost else f"; no η fell more than {tolerance} behind per sample") + ".")
    top = max(r.eta for r in rows)
    by_loss = {r.loss: r for r in rows if r.eta == top}
    if "decoupled" not in by_loss or "plain" not in by_loss:
        return lines
    dec, plain = by_loss["decoupled"], by_loss["plain"]
    low = min(r.eta for r in rows)
    diff = dec.auc_samples - plain.auc_samples
    # A difference counts only past the tolerance and with the seeds' ranges apart.
    apart = dec.auc_range[0] > plain.auc_range[1] or plain.auc_range[0] > dec.auc_range[1]
    if abs(diff) <= tolerance:
        what = f"decoupled and plain are within {tolerance} of each other"
    elif not apart:
        what = (f"decoupled and plain differ by more than {tolerance} but their seeds "
                "overlap (noise)")
    elif diff > 0:
        what = "the decoupled loss held up better than plain"
    else:
        what = "the plain loss did better than decoupled"
    lines.append(
        f"At the highest staleness (η = {top}, realized mean {dec.stale_mean:.1f} / "
        f"{plain.stale_mean:.1f}, max {dec.stale_max} / {plain.stale_max}) {what}: AUC "
        f"samples {dec.auc_samples:.3f} vs {plain.auc_samples:.3f} ({diff:+.3f}), final "
        f"accuracy {dec.final_acc:.3f} vs {plain.final_acc:.3f}; against η = {low} at "
        f"equal samples decoupled is {dec.gap_samples:+.3f} and plain {plain.gap_samples:+.3f}"
        f", at equal seconds {dec.gap_time:+.3f} and {plain.gap_time:+.3f}.")
    return lines


def plan(staleness: Sequence[int], seeds: Sequence[int]) -> list[tuple[int, str, int]]:
    """(η, loss, seed) in run order: per seed η ascending then descending for the next
    seed; the two losses of an η back to back, their order alternating (ABBA)."""
    order, pair = [], 0
    for number, seed in enumerate(seeds):
        for eta in staleness if number % 2 == 0 else list(reversed(staleness)):
            losses = list(LOSSES) if pair % 2 == 0 else list(reversed(LOSSES))
            order += [(eta, loss, seed) for loss in losses]
            pair += 1
    return order


def print_table(rows: Sequence[ArmRow], sample_points: Sequence[int], title: str) -> None:
    table = Table(title=title, caption="mean over seeds; AUC: mean accuracy over the sample "
                  "budget / over the shortest trial's training time; Δ: accuracy minus the "
                  "smallest η's (same loss) at equal samples / seconds, matched to each "
                  "evaluation's span of versions; stale: realized; clip, "
                  "out of band (pi/pi_behaviour outside the clip band), KL(behaviour || "
                  "current): per-step means over tokens")
    for column in ("η", "loss", "seeds", "final acc [min, max]",
                   *(f"acc@{n}" for n in sample_points), "AUC samples", "AUC time",
                   "Δ samples", "Δ time",
                   "stale mean", "stale max", "drops", "clip %", "out of band %",
                   "KL behav", "eval span", "wall s", "groups/s"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(str(r.eta), r.loss, str(r.seeds),
                      f"{r.final_acc:.3f} [{r.final_min:.2f}, {r.final_max:.2f}]",
                      *(f"{a:.3f}" for a in r.acc_at), f"{r.auc_samples:.3f}",
                      f"{r.auc_time:.3f}", f"{r.gap_samples:+.3f}", f"{r.gap_time:+.3f}",
                      f"{r.stale_mean:.2f}", str(r.stale_max),
                      f"{r.dropped:.0f}", f"{100 * r.off_policy['clip_fraction']:.2f}",
                      f"{100 * r.off_policy['is_out_of_band_fraction']:.2f}",
                      f"{r.off_policy['kl_behaviour']:.1e}", f"{r.eval_span:.1f}",
                      f"{r.wall_s:.0f}", f"{r.groups_per_s:.2f}")
    diff = Table(title="decoupled minus plain, per η")
    for column in ("η", "final acc", "AUC samples", "AUC time"):
        diff.add_column(column, justify="right")
    for eta in sorted({r.eta for r in rows}):
        pair = {r.loss: r for r in rows if r.eta == eta}
        if {"decoupled", "plain"} <= set(pair):
            d, p = pair["decoupled"], pair["plain"]
            diff.add_row(str(eta), f"{d.final_acc - p.final_acc:+.3f}",
                         f"{d.auc_samples - p.auc_samples:+.3f}",
                         f"{d.auc_time - p.auc_time:+.3f}")
    console = Console(width=250)
    console.print(table)
    console.print(diff)


def write_csv(path: Path, rows: Sequence[ArmRow], sample_points: Sequence[int]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        names = [n.name for n in msgspec.structs.fields(ArmRow)
                 if n.name not in ("acc_at", "off_policy", "auc_range")]
        writer.writerow(names + [f"acc_at_{n}" for n in sample_points] + list(OFF_POLICY)
                        + ["auc_samples_min", "auc_samples_max"])
        for r in rows:
            writer.writerow([round(v, 4) if isinstance(v := getattr(r, name), float) else v
                             for name in names] + [round(a, 4) for a in r.acc_at]
                            + [f"{r.off_policy[key]:.3g}" for key in OFF_POLICY]
                            + [round(a, 4) for a in r.auc_range])


def write_plot(path: Path, trials: Sequence[TrialFigures], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = sorted({t.eta for t in trials})
    colours = plt.get_cmap("viridis")(np.linspace(0.0, 0.9, max(len(etas), 2)))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, axis, label in ((axes[0], "samples", "samples trained"),
                            (axes[1], "wall", "training wall time (s)")):
        for (eta, colour) in zip(etas, colours, strict=False):
            for loss, style in (("decoupled", "-"), ("plain", "--")):
                arm = [t for t in trials if (t.eta, t.loss) == (eta, loss)]
                if not arm:
                    continue
                for t in arm:
                    ax.plot(getattr(t, axis), t.accuracy, style, color=colour, lw=0.6,
                            alpha=0.35, marker=".", ms=3)
                end = min(getattr(t, axis)[-1] for t in arm)
                grid = np.linspace(0.0, end, GRID)
                mean = np.mean([at(getattr(t, axis), t.accuracy, grid) for t in arm], axis=0)
                ax.plot(grid, mean, style, color=colour, lw=2,
                        label=f"η={eta} {loss} (stale {np.mean([t.stale_mean for t in arm]):.1f})")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--config", default="examples/cpu_longtail.toml")
    parser.add_argument("--out", default="runs/staleness-ablation")
    parser.add_argument("--staleness", type=int, nargs="+", default=None,
                        help="max_staleness values (default 0 1 2 4 8; --quick: 0 4)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run.seed values (default 0 1; --quick: 0)")
    parser.add_argument("--steps", type=int, default=None,
                        help="run.num_steps of every trial (default 30; --quick: 12)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="run.eval_every (default 2; --quick: 3)")
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="accuracy at equal samples the verdict lets an η lose (default: "
                             "about the standard error of a 2-seed mean of one 100-prompt "
                             "evaluation, 0.033)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: see the defaults")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="config override (repeatable)")
    args = parser.parse_args(argv)
    staleness = args.staleness or ([0, 4] if args.quick else [0, 1, 2, 4, 8])
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1])
    steps = args.steps or (12 if args.quick else 30)
    eval_every = args.eval_every or (3 if args.quick else 2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*SHARED, f"run.eval_every={eval_every}", *args.overrides]
    try:  # once, not per trial: e.g. no model yet (the line says how to build it)
        check_inputs(load_config(args.config, overrides))
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2

    order = plan(staleness, seeds)
    done: list[TrialFigures] = []
    failed = 0
    for number, (eta, loss, seed) in enumerate(order, 1):
        trial = Trial(name=f"eta{eta}-{loss}-seed{seed}", repeat=0, values=(
            ("staleness.max_staleness", str(eta)), ("trainer.tis_cap", LOSSES[loss]),
            ("run.seed", str(seed))))
        print(f"[{number}/{len(order)}] η = {eta}, {loss}, seed {seed}: ", end="", flush=True)
        result = run_trial(args.config, trial, out / trial.name, overrides, steps)
        print(describe(result), flush=True)
        if result.status == "failed" or not (result.run_dir / SUMMARY).exists():
            failed += 1
            continue
        done.append(figures(read_summary(result.run_dir), eta, loss, seed,
                            step_means(result.run_dir)))
    if not done:
        print("no trial finished", file=sys.stderr)
        return 1

    budget = min(t.samples_trained for t in done)
    sample_points = [budget // 4, budget // 2]
    rows = aggregate(done, sample_points)
    title = (f"staleness ablation: {args.config}, {steps} steps, {budget} samples, "
             f"seeds {' '.join(map(str, seeds))}, {' '.join(SHARED[:3])}")
    print_table(rows, sample_points, title)
    write_csv(out / "ablation.csv", rows, sample_points)
    write_plot(out / "staleness_ablation.png", done, title)
    print("verdict:")
    for line in verdict(rows, args.tolerance):
        print(f"- {line}")
    print(f"written: {out / 'ablation.csv'}, {out / 'staleness_ablation.png'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
