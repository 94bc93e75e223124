"""bench/resume_kept.py's ledger reading: the work a stop left (queued groups, in-flight
rollouts), its tokens, and what the resume generated again."""

from __future__ import annotations

import pytest
from script_modules import load_script

from buffers.common.reports import LedgerEntry

bench = load_script("bench/resume_kept.py", "bench_resume_kept")


def entry(prompt: str, event: str, time: float, *, reason: str = "",
          lengths: tuple[int, ...] = (), version: int = 3) -> LedgerEntry:
    return LedgerEntry(prompt_id=prompt, event=event, version=version, time=time,
                       reason=reason, lengths=lengths)


STOPPED = [
    # The stopped run's decode rate: the median of its groups' longest sample over their
    # time: 6, 7 and 20 tokens a second, 7.
    entry("done", "admitted", 0.0), entry("done", "generated", 1.0, lengths=(4, 6)),
    entry("done", "trained", 2.0),
    # Queued at the stop: 10 tokens.
    entry("kept", "admitted", 0.0), entry("kept", "generated", 1.0, lengths=(3, 7)),
    # Queued at the stop and too stale after the resume: 20 tokens.
    entry("stale", "admitted", 0.0), entry("stale", "generated", 1.0, lengths=(20,)),
    # In flight for 0.5 s (3.5 tokens a sequence) before the stop.
    entry("flying", "admitted", 9.5),
    entry("kept", "unfinished", 10.0, reason="run_ended"),
    entry("stale", "unfinished", 10.0, reason="run_ended"),
    entry("flying", "unfinished", 10.0, reason="run_ended"),
]


def test_queued_groups_kept_and_in_flight_rollouts_estimated() -> None:
    resumed = [
        entry("flying", "requeued", 20.0, reason="resume"),
        entry("kept", "restored", 20.0, reason="resume"),
        entry("stale", "restored", 20.0, reason="resume"),
        entry("stale", "dropped", 20.0, reason="stale"),
        entry("stale", "requeued", 20.0, reason="stale"),
        entry("flying", "admitted", 21.0), entry("stale", "admitted", 21.0),
        entry("kept", "trained", 22.0),
        entry("flying", "generated", 25.0, lengths=(2, 6)),
        entry("stale", "generated", 25.0, lengths=(9,)),
    ]
    result = bench.figures(STOPPED + resumed)
    assert result.resumed_at == 3
    work = {w.prompt_id: w for w in result.work}
    assert sorted(work) == ["flying", "kept", "stale"]  # "done" was trained
    assert (work["kept"].queued, work["kept"].tokens, work["kept"].regenerated) == (
        True, 10.0, False)
    assert work["stale"].too_stale and work["stale"].regenerated
    # Its next generation's samples, 2 and 6 tokens: min(2, 3.5) + min(6, 3.5) at the stop.
    assert not work["flying"].queued and work["flying"].tokens == pytest.approx(5.5)
    assert result.restored_untouched == 1 and result.trained_twice == []
    assert result.fraction(queued=True) == pytest.approx(20 / 30)
    assert result.fraction(queued=False) == 1.0
    assert result.fraction() == pytest.approx(25.5 / 35.5)


def test_today_every_queued_group_is_generated_again() -> None:
    resumed = [entry(p, e, 20.0 + k, reason="resume" if e == "requeued" else "",
                     lengths=(5,) if e == "generated" else ())
               for p in ("kept", "stale", "flying")
               for k, e in enumerate(("requeued", "admitted", "generated", "trained"))]
    result = bench.figures(STOPPED + resumed)
    assert len(result.work) == 3 and result.restored_untouched == 0
    assert result.fraction() == 1.0


def test_the_decode_rate_is_the_median_group_s_longest_sample_per_second() -> None:
    entries = [entry("a", "admitted", 0.0), entry("a", "generated", 2.0, lengths=(3, 10)),
               entry("b", "admitted", 1.0), entry("b", "generated", 2.0, lengths=(8,)),
               entry("c", "admitted", 1.0), entry("c", "generated", 2.0, lengths=(1,)),
               entry("d", "generated", 2.0, lengths=(99,))]  # admitted before: not counted
    assert bench.decode_rate(entries) == 5.0
    assert bench.decode_rate([]) == 0.0


def test_a_ledger_without_a_resume_is_refused() -> None:
    with pytest.raises(ValueError, match="no resumed run"):
        bench.figures(STOPPED)


def test_handed_back_rollouts_are_counted_from_the_ledger_and_kept() -> None:
    """Two rollouts in flight at the stop, handed back with 3 + 4 and 5 tokens kept: the
    first continued and trained (kept), the second too stale at the resume (dropped,
    generated again); neither is estimated."""
    stopped = [
        entry("done", "admitted", 0.0), entry("done", "generated", 1.0, lengths=(4, 6)),
        entry("done", "trained", 2.0),
        entry("cont", "admitted", 9.0), entry("old", "admitted", 9.0),
        entry("cont", "handed_back", 10.0, reason="stop", lengths=(3, 4)),
        entry("old", "handed_back", 10.0, reason="stop", lengths=(5,)),
        entry("cont", "unfinished", 10.0, reason="run_ended"),
        entry("old", "unfinished", 10.0, reason="run_ended"),
    ]
    resumed = [
        entry("cont", "partial_restored", 20.0, reason="resume", lengths=(3, 4)),
        entry("old", "partial_restored", 20.0, reason="resume", lengths=(5,)),
        entry("old", "dropped", 20.0, reason="stale"),
        entry("old", "requeued", 20.0, reason="stale"),
        entry("cont", "admitted", 21.0, reason="continue", lengths=(3, 4)),
        entry("old", "admitted", 21.0),
        entry("cont", "generated", 22.0, lengths=(6, 9)),
        entry("old", "generated", 22.0, lengths=(8,)),
        entry("cont", "trained", 23.0), entry("old", "trained", 23.0),
    ]
    result = bench.figures(stopped + resumed)
    work = {w.prompt_id: w for w in result.work}
    assert sorted(work) == ["cont", "old"]
    assert work["cont"].handed_back and work["cont"].tokens == 7.0
    assert not work["cont"].regenerated
    assert work["old"].handed_back and work["old"].regenerated and work["old"].too_stale
    assert result.fraction(queued=False) == pytest.approx(5 / 12)
    assert result.trained_twice == []
