"""What a stop and ``--resume`` keep of the work generated and not yet trained.

Runs ``async-rl train`` on the long-tail task as a subprocess, sends it SIGINT once
``--stop-at`` steps are logged (the run finishes the step in progress, then writes its
checkpoint), and continues it with ``async-rl train --resume`` to ``--steps``. Then reads
the run's ledger (``figures``): the prompts the stop left unfinished are the work that
existed and was not trained, split in two by their current attempt's events before the
resume —

- **queued groups**: generated (a ``generated`` event) and not trained; their tokens are
  that event's completion lengths (the members');
- **in-flight rollouts**: admitted and not generated. One its engine handed back at the
  stop has a ``handed_back`` event carrying the tokens it kept per sample: exactly what
  the checkpoint's partials file holds (the resume's ``partial_restored`` event carries
  the same), so those are counted, not estimated. Only a rollout no engine handed back
  (a worker that cannot) is estimated: each sample of the same prompt's next generation
  counts its length, capped at what the stopped run decoded per sequence in the time
  the rollout ran before the stop (``decode_rate``: the median over the stopped run's
  groups of their longest sample over their generation time).

A queued group, or a rollout not handed back, is generated again when its prompt has a
``generated`` event after the resume (a queued group restored and then dropped as too
stale is generated again, and counted as such). A rollout handed back is continued, not
generated again: its kept tokens are generated again only when its prompt is dropped
(too stale at the restore or later) or fails after the resume. The resume starts at the
ledger's first event with reason ``resume``.

Printed: the stop's step, the queued groups and in-flight rollouts with their tokens and
how many of each were generated again, the groups too stale to train after the resume,
restored groups trained without a new ``generated`` event, prompts trained twice (must
be 0), and last ``resume_kept: regenerated fraction R (queued groups Rq, in-flight
rollouts Ri)``, R over the tokens of both. ``--analyse-only`` reads an existing run.

    python -m bench.resume_kept --model runs/longtail-model
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from async_rl.run.run_dir import METRICS, read_ledger
from buffers.common.reports import LedgerEntry
from buffers.queue.queue_records import DROP_STALE

ROOT = Path(__file__).resolve().parents[1]
RESUME = "resume"
"""The ledger reason of what a resumed run issues again (or restores) from its checkpoint."""


class Work(NamedTuple):
    """One prompt the stop left unfinished."""

    prompt_id: str
    queued: bool
    """Generated before the stop (a group in the queue); else in flight."""
    tokens: float
    """Completion tokens it held at the stop (estimated for an in-flight rollout that was
    not handed back)."""
    regenerated: bool
    too_stale: bool
    """Dropped as stale after the resume."""
    handed_back: bool = False
    """In flight and handed back by its engine: its tokens counted from the ledger."""


class Figures(NamedTuple):
    resumed_at: int
    """The version of the checkpoint the run resumed from (the stop's step)."""
    work: list[Work]
    restored_untouched: int
    """Queued groups trained after the resume with no new generated event."""
    trained_twice: list[str]

    def fraction(self, queued: bool | None = None) -> float:
        """Regenerated tokens over the stop's tokens (``queued``: of one kind only)."""
        chosen = [w for w in self.work if queued is None or w.queued == queued]
        total = sum(w.tokens for w in chosen)
        return sum(w.tokens for w in chosen if w.regenerated) / total if total else 0.0


def figures(entries: Sequence[LedgerEntry]) -> Figures:
    """The work the stop left and what the resume did with it (see the module docstring)."""
    boundary = next((i for i, e in enumerate(entries) if e.reason == RESUME), None)
    if boundary is None:
        raise ValueError("no resumed run in this ledger (no event with reason 'resume')")
    rate = decode_rate(entries[:boundary])
    before: dict[str, list[LedgerEntry]] = defaultdict(list)
    after: dict[str, list[LedgerEntry]] = defaultdict(list)
    for i, entry in enumerate(entries):
        (before if i < boundary else after)[entry.prompt_id].append(entry)
    work = []
    for prompt_id, history in before.items():
        if history[-1].event != "unfinished":
            continue
        admitted = max(i for i, e in enumerate(history) if e.event == "admitted")
        generated = [e for e in history[admitted:] if e.event == "generated"]
        handed = [e for e in history[admitted:] if e.event == "handed_back"]
        later = after[prompt_id]
        regen = [e for e in later if e.event == "generated"]
        if generated:
            tokens = float(sum(generated[-1].lengths))
            regenerated = bool(regen)
        elif handed:
            tokens = float(sum(handed[-1].lengths))
            regenerated = any(e.event in ("dropped", "failed") for e in later)
        else:
            ran_s = history[-1].time - history[admitted].time
            tokens = float(sum(min(n, rate * ran_s) for n in regen[0].lengths)) if regen else 0.0
            regenerated = bool(regen)
        work.append(Work(
            prompt_id=prompt_id, queued=bool(generated), tokens=tokens,
            regenerated=regenerated, handed_back=bool(handed) and not generated,
            too_stale=any((e.event, e.reason) == ("dropped", DROP_STALE) for e in later)))
    trained = Counter(e.prompt_id for e in entries if e.event == "trained")
    untouched = sum(1 for w in work if w.queued and not w.regenerated
                    and any(e.event == "trained" for e in after[w.prompt_id]))
    return Figures(resumed_at=entries[boundary].version, work=work,
                   restored_untouched=untouched,
                   trained_twice=sorted(p for p, n in trained.items() if n > 1))


def decode_rate(entries: Sequence[LedgerEntry]) -> float:
    """Tokens a sequence gets per second: the median over the groups generated in
    ``entries`` of their longest sample's length over the time from their admission."""
    admitted: dict[tuple[str, int], float] = {}
    rates = []
    for e in entries:
        if e.event == "admitted":
            admitted[(e.prompt_id, e.attempt)] = e.time
        elif e.event == "generated" and e.lengths and (e.prompt_id, e.attempt) in admitted:
            took = e.time - admitted[(e.prompt_id, e.attempt)]
            if took > 0:
                rates.append(max(e.lengths) / took)
    return statistics.median(rates) if rates else 0.0


def rows_logged(run_dir: Path) -> int:
    path = run_dir / METRICS
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def train(args: list[str], log: Path, stop_at: int = 0, run_dir: Path | None = None) -> int:
    """``async-rl train ARGS`` of this tree (its output to ``log``); with ``stop_at``,
    SIGINT once ``run_dir`` logged that many steps. Returns the exit status."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    with log.open("wb") as out:
        child = subprocess.Popen([sys.executable, "-m", "async_rl.cli", "train", *args],
                                 stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        if stop_at and run_dir is not None:
            while child.poll() is None and rows_logged(run_dir) < stop_at:
                time.sleep(0.05)
            if child.poll() is None:
                child.send_signal(signal.SIGINT)
        return child.wait(timeout=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/cpu_longtail.toml")
    parser.add_argument("--model", default="runs/longtail-model", help="model.path")
    parser.add_argument("--stop-at", type=int, default=10, help="SIGINT once this many steps")
    parser.add_argument("--steps", type=int, default=20, help="run.num_steps")
    parser.add_argument("--out-dir", default="runs/resume-kept")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--analyse-only", action="store_true",
                        help="read the ledger of an existing --out-dir, run nothing")
    args = parser.parse_args()
    out = Path(args.out_dir).resolve()
    if not args.analyse_only:
        sets = [f"model.path={Path(args.model).resolve()}", f"run.output_dir={out}",
                f"run.num_steps={args.steps}", "run.progress=false", "run.eval_every=0",
                "task.eval_size=0", *args.overrides]
        first = [str(Path(args.config).resolve()), "--overwrite",
                 *(a for s in sets for a in ("--set", s))]
        out.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        code = train(first, out.parent / f"{out.name}-stop.log", args.stop_at, out)
        print(f"stopped run: exit {code} after {time.monotonic() - started:.0f} s")
        code = train(["--resume", str(out), "--set", "run.progress=false"],
                     out.parent / f"{out.name}-resume.log")
        print(f"resumed run: exit {code} after {time.monotonic() - started:.0f} s")
        if code != 0:
            sys.exit(f"the resumed run failed (exit {code}): see {out.parent}")
    result = figures(read_ledger(out))
    print(f"resumed from the checkpoint of step {result.resumed_at}")
    queued = [w for w in result.work if w.queued]
    flying = [w for w in result.work if not w.queued]
    for name, chosen in (("queued groups", queued), ("in-flight rollouts", flying)):
        print(f"{name} at the stop: {len(chosen)}, {sum(w.tokens for w in chosen):.0f} "
              f"tokens; generated again: {sum(w.regenerated for w in chosen)}, "
              f"{sum(w.tokens for w in chosen if w.regenerated):.0f} tokens")
    handed = [w for w in flying if w.handed_back]
    print(f"in-flight rollouts handed back by their engines and kept: {len(handed)}, "
          f"{sum(w.tokens for w in handed):.0f} tokens (counted from the ledger's "
          f"handed_back events: what the checkpoint kept); estimated: "
          f"{len(flying) - len(handed)}")
    print(f"groups too stale to train after the resume: {sum(w.too_stale for w in queued)} "
          f"queued, {sum(w.too_stale for w in flying)} in flight")
    print(f"queued groups trained after the resume without a new generated event: "
          f"{result.restored_untouched}")
    print(f"prompts trained twice: {len(result.trained_twice)}")
    print(f"resume_kept: regenerated fraction {result.fraction():.3f} (queued groups "
          f"{result.fraction(queued=True):.3f}, in-flight rollouts "
          f"{result.fraction(queued=False):.3f})")


if __name__ == "__main__":
    main()
