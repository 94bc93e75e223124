"""bench/algorithms/staleness_ablation.py without training: trial order, curves, per-arm figures and
the verdict, on small synthetic trials."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from script_modules import load_script

from async_rl.run.summary import EvalPoint, RunSummary

ab = load_script("bench/algorithms/staleness_ablation.py", "staleness_ablation")


def trial(eta: int, loss: str, seed: int, accuracy: tuple[float, ...], *,
          end_s: float = 100.0, hist: tuple[int, ...] = (10,), dropped: int = 0,
          kl: float = 0.0):
    n = len(accuracy) - 1
    samples, wall = [1000 * i // n for i in range(n + 1)], [end_s * i / n for i in range(n + 1)]
    return ab.TrialFigures(
        eta=eta, loss=loss, seed=seed, samples=tuple(samples), wall=tuple(wall),
        accuracy=accuracy, sample_spans=tuple((x, x) for x in samples),
        wall_spans=tuple((x, x) for x in wall),
        samples_trained=1000, wall_s=end_s, groups_per_s=1000 / 8 / end_s,
        staleness_histogram=hist, dropped_stale=dropped,
        off_policy={"kl_behaviour": kl, "clip_fraction": 0.0, "is_out_of_band_fraction": 0.0})


def row(eta: int, loss: str, gap_samples: float, gap_time: float, *,
        auc_samples: float = 0.6, **kw: object):
    figures = dict(seeds=2, final_acc=auc_samples, final_min=0.0, final_max=1.0, acc_at=(),
                   auc_samples=auc_samples, auc_time=0.5,
                   auc_range=(auc_samples - 0.005, auc_samples + 0.005),
                   stale_mean=float(eta), stale_max=eta, dropped=0.0, wall_s=100.0,
                   groups_per_s=1.0, off_policy=dict.fromkeys(ab.OFF_POLICY, 0.0),
                   eval_span=0.0)
    return ab.ArmRow(eta=eta, loss=loss, gap_samples=gap_samples, gap_time=gap_time,
                     **{**figures, **kw})


def test_plan_pairs_the_losses_abba_and_reverses_staleness_per_seed() -> None:
    order = ab.plan([0, 4], [0, 1])
    assert order == [(0, "decoupled", 0), (0, "plain", 0), (4, "plain", 0),
                     (4, "decoupled", 0), (4, "decoupled", 1), (4, "plain", 1),
                     (0, "plain", 1), (0, "decoupled", 1)]
    assert len(set(ab.plan([0, 1, 2, 4, 8], [0, 1]))) == 20


def test_curve_interpolates_between_evaluations_and_stays_flat_past_the_end() -> None:
    assert list(ab.at([0, 100], [0.0, 1.0], [50, 200])) == [0.5, 1.0]
    assert ab.auc([0, 100], [0.0, 1.0], 100) == pytest.approx(0.5)
    # Past the last evaluation the curve holds its last value: 0.5 + 1.0 over two halves.
    assert ab.auc([0, 100], [0.0, 1.0], 200) == pytest.approx(0.75)
    assert ab.auc([0, 100], [0.0, 1.0], 0) == 0.0


def test_figures_charge_evaluations_mid_version_and_read_staleness() -> None:
    def point(step: int, samples: int, wall: float, accuracy: float,
              version_min: int | None = None) -> EvalPoint:
        version = samples // 64
        return EvalPoint(step=step, version=version, accuracy=accuracy, wall_s=wall,
                         version_min=version if version_min is None else version_min,
                         samples_trained=samples, groups_trained=samples // 8,
                         tokens_trained=0, eval_s=1.0, num_prompts=200)

    summary = RunSummary(
        steps=4, final_version=4, rollout_version=4, wall_s=40.0, groups_trained=32,
        tokens_trained=0, groups_per_s=0.8, tokens_per_s=0.0, accuracy_start=0.1,
        accuracy_end=0.6, staleness_histogram=(2, 0, 5, 1), dropped_stale=3,
        rollout_failures=0, reward_failures=0, nonfinite_steps=0, retired_workers=0,
        max_staleness=4, samples_trained=256,
        # The step-2 evaluation scored versions 1 to 3: charged at version 2, whose time
        # lies between version 0's (0 s) and version 3's (30 s).
        evals=(point(4, 256, 40.0, 0.6), point(0, 0, 0.0, 0.1),
               point(2, 192, 30.0, 0.3, version_min=1)))
    t = ab.figures(summary, 4, "plain", 1)
    assert t.samples == (0, 128, 256) and t.accuracy == (0.1, 0.3, 0.6)
    assert t.wall == pytest.approx((0.0, 20.0, 40.0))
    assert t.eval_span == pytest.approx(1.0)  # the end-of-run evaluation does not count
    assert t.stale_mean == pytest.approx((2 * 5 + 3 * 1) / 8)
    assert t.stale_max == 3


def test_step_means_average_the_off_policy_figures_over_steps(tmp_path: Path) -> None:
    lines = ['{"step": 1, "clip_fraction": 0.0, "is_out_of_band_fraction": 0.1, '
             '"kl_behaviour": 0.002}',
             '{"step": 2, "clip_fraction": 0.2, "is_out_of_band_fraction": 0.3, '
             '"kl_behaviour": 0.004}',
             '{"event": "not a step"}', ""]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert ab.step_means(tmp_path) == pytest.approx(
        {"clip_fraction": 0.1, "is_out_of_band_fraction": 0.2, "kl_behaviour": 0.003})


def test_aggregate_means_seeds_and_integrates_on_common_horizons() -> None:
    trials = [trial(0, "decoupled", 0, (0.0, 0.4, 0.8), kl=0.01),
              trial(0, "decoupled", 1, (0.0, 0.2, 0.6), kl=0.03),
              # Twice as slow: its time curve is integrated over the other trials' 100 s.
              trial(0, "plain", 0, (0.0, 0.4, 0.8), end_s=200.0, hist=(1, 1), dropped=4)]
    rows = ab.aggregate(trials, [250, 500])
    assert [(r.eta, r.loss, r.seeds) for r in rows] == [(0, "decoupled", 2), (0, "plain", 1)]
    dec, plain = rows
    assert dec.final_acc == pytest.approx(0.7)
    assert (dec.final_min, dec.final_max) == (0.6, 0.8)
    assert dec.acc_at == pytest.approx((0.15, 0.3))
    assert dec.auc_samples == pytest.approx(0.325, abs=1e-3)  # trapezoids: 0, 0.3, 0.7
    assert dec.auc_range == pytest.approx((0.25, 0.4), abs=1e-3)
    assert plain.auc_samples == pytest.approx(0.4, abs=1e-3)
    assert plain.auc_time == pytest.approx(0.2, abs=1e-3)  # first half of its curve
    assert dec.auc_time == pytest.approx(dec.auc_samples, abs=1e-3)
    assert (plain.stale_mean, plain.stale_max, plain.dropped) == (0.5, 1, 4.0)
    assert dec.off_policy["kl_behaviour"] == pytest.approx(0.02)
    # Each seed against both: +0.1 and -0.1; plain against itself: 0.
    assert (dec.gap_samples, plain.gap_samples, plain.gap_time) == pytest.approx((0, 0, 0))
    assert ab.aggregate([], [1]) == []


def test_matched_gap_measures_the_reference_as_the_trial_was_measured() -> None:
    # A concave reference curve, densely evaluated.
    reference = ab.TrialFigures(
        eta=0, loss="plain", seed=0, samples=(0, 500, 1000), wall=(0.0, 50.0, 100.0),
        accuracy=(0.0, 0.8, 1.0), sample_spans=((0, 0), (500, 500), (1000, 1000)),
        wall_spans=((0, 0), (50, 50), (100, 100)), samples_trained=1000, wall_s=100.0,
        groups_per_s=1.0, staleness_histogram=(1,), dropped_stale=0)
    # One wide evaluation over versions that trained 0..1000 samples in 0..50 s, scoring
    # what the reference scores on average over that span (0.65, not its 0.8 at 500).
    wide = msgspec.structs.replace(
        reference, eta=8, samples=(0, 500, 1000), accuracy=(0.0, 0.65, 1.0),
        sample_spans=((0, 0), (0, 1000), (1000, 1000)),
        wall_spans=((0, 0), (0, 50), (50, 50)))
    assert ab.matched_gap(wide, [reference], "samples") == pytest.approx(0.0, abs=0.01)
    # In time the same span ended at 50 s, where the reference had 0.8 only at its end.
    assert ab.matched_gap(wide, [reference], "wall") == pytest.approx(
        ((0.65 - 0.4) + (1.0 - 0.8)) / 2, abs=0.01)
    ahead = msgspec.structs.replace(wide, accuracy=(0.0, 0.75, 1.0))
    assert ab.matched_gap(ahead, [reference], "samples") == pytest.approx(0.05, abs=0.01)


def test_pick_is_the_fastest_staleness_that_keeps_accuracy_per_sample() -> None:
    rows = [row(0, "decoupled", 0.0, 0.0), row(2, "decoupled", -0.01, 0.05),
            row(8, "decoupled", -0.1, 0.08)]
    pick, base = ab.pick_staleness(rows, "decoupled", tolerance=0.02)
    assert (pick.eta, base.eta) == (2, 0)  # η = 8 is fastest but learns less per sample
    assert ab.pick_staleness(rows, "decoupled", tolerance=0.2)[0].eta == 8
    slow = [row(0, "plain", 0.0, 0.0), row(4, "plain", 0.0, -0.03)]
    assert ab.pick_staleness(slow, "plain", tolerance=0.02)[0].eta == 0


@pytest.mark.parametrize(("plain_auc", "says"), [
    (0.40, "the decoupled loss held up better than plain"),
    (0.60, "the plain loss did better than decoupled"),
    (0.51, "within 0.02 of each other"),
])
def test_verdict_compares_the_losses_at_the_highest_staleness(plain_auc: float,
                                                              says: str) -> None:
    rows = [row(0, "decoupled", 0.0, 0.0), row(0, "plain", 0.0, 0.0),
            row(8, "decoupled", -0.08, 0.1, auc_samples=0.52),
            row(8, "plain", -0.03, 0.1, auc_samples=plain_auc)]
    lines = ab.verdict(rows, tolerance=0.02)
    assert len(lines) == 3
    assert lines[0].startswith("decoupled: pick max_staleness = 0")
    assert "η = 8 (-0.080) fell more than 0.02 behind" in lines[0]
    assert says in lines[2] and "η = 8" in lines[2]
    assert "decoupled is -0.080 and plain -0.030" in lines[2]


def test_verdict_calls_a_difference_with_overlapping_seeds_noise() -> None:
    rows = [row(0, "decoupled", 0.0, 0.0), row(0, "plain", 0.0, 0.0),
            row(8, "decoupled", 0.0, 0.1, auc_samples=0.55, auc_range=(0.45, 0.65)),
            row(8, "plain", 0.0, 0.1, auc_samples=0.50)]
    assert "their seeds overlap (noise)" in ab.verdict(rows, tolerance=0.02)[2]


def test_verdict_without_both_losses_only_picks() -> None:
    lines = ab.verdict([row(0, "decoupled", 0.0, 0.0), row(4, "decoupled", 0.0, 0.1)], 0.02)
    assert lines == [lines[0]] and "pick max_staleness = 4" in lines[0]
    assert "no η fell more than 0.02 behind" in lines[0]
