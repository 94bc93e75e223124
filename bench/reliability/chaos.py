"""Chaos benchmark: kill workers of a real run at random times; is anything lost?

Runs ``async-rl train`` as a subprocess (own session) and SIGKILLs a rollout actor's
process (title ``ray::RolloutActor...``) ``--kills`` times and, once in the middle third,
the trainer actor's (``ray::TrainerActor...``): the actor's process only, not the vLLM
engine core under it, as a crashed worker dies (whether the engine core goes too is
part of the leftover check). Dead rollout workers should be restarted; after the trainer
dies the run should exit 1 with one ``run failed:`` line, and is continued with
``--resume`` (from the newest periodic checkpoint). Any other exit, or an attempt past
``--timeout``, is a benchmark failure. ``random.Random(--seed)`` draws the schedule: a
kill falls due once the run logged a given step, plus up to 1.5 s, when this attempt's
workers are up and no rollout restart is in progress. A seed reproduces the schedule,
not the exact instants.

Printed: steps; kills; rollout restarts summed over attempts from their output (a resume
restores its checkpoint's count, so summary.json misses restarts between that checkpoint
and the trainer kill); resumes; prompts lost (admitted, last ledger event neither
``trained`` nor ``unfinished``) and trained twice (both must be 0); trained groups vs
steps x groups_per_step; processes of the run alive 20 s after each attempt (descendants
of the train subprocess seen while it ran, then killed: must be 0); wall time; the
command that reproduces it. Exit 1 if a check fails. Logs: OUT/attempt-N.out, .err.

    python -m bench.reliability.chaos --set model.path=runs/small-model
    python -m bench.reliability.chaos --seed 3 --steps 40 --kills 2 --no-trainer-kill
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import psutil
from rich.console import Console
from rich.table import Table

from async_rl.config_io import load_config
from async_rl.control.prompt_ledger import FILTERED
from async_rl.run.inputs import check_inputs
from async_rl.run.run_dir import METRICS, WORKERS, read_ledger, read_summary
from buffers.common.config import ConfigError
from buffers.common.reports import LedgerEntry

ROOT = Path(__file__).resolve().parents[2]
ROLLOUT, TRAINER = "ray::RolloutActor", "ray::TrainerActor"
# Not anchored at line starts: Ray's log monitor may print a message without its newline
# just before (a dead worker's), so the driver's line can begin mid-line.
LOST = re.compile(r"rollout-\d+ lost \(.*?\): restarting it")
RESTARTED = re.compile(r"rollout-\d+ restarted at version")


class Kill(NamedTuple):
    """Due ``delay_s`` after the run logged ``step``; ``target``: ROLLOUT or TRAINER (a
    process title's prefix); ``pick`` in [0, 1): which of several (by pid order)."""

    step: int
    target: str
    delay_s: float
    pick: float


def plan_kills(seed: int, steps: int, kills: int, trainer_kill: bool,
               checkpoint_every: int) -> list[Kill]:
    """The kill schedule, in step order. The trainer dies once in the middle third,
    after the first checkpoint (a resume needs one); rollout kills fall on other steps."""
    rng = random.Random(seed)
    schedule = []
    trainer_step = None
    if trainer_kill:
        low, high = max(steps // 3, checkpoint_every + 1), (2 * steps) // 3
        if not checkpoint_every or low > high:
            raise ValueError(f"no step for the trainer kill: after the first checkpoint "
                             f"({checkpoint_every}) and in the middle third of {steps} steps")
        trainer_step = rng.randint(low, high)
        schedule.append(Kill(trainer_step, TRAINER, rng.uniform(0, 1.5), rng.random()))
    candidates = [s for s in range(2, steps - 1) if s != trainer_step]
    if kills > len(candidates):
        raise ValueError(f"{kills} rollout kills do not fit in {steps} steps")
    for step in rng.sample(candidates, kills):
        schedule.append(Kill(step, ROLLOUT, rng.uniform(0, 1.5), rng.random()))
    return sorted(schedule)


class LedgerFigures(NamedTuple):
    admitted: int
    trained: int
    unfinished: int
    lost: list[str]
    trained_twice: list[str]


def ledger_figures(entries: Iterable[LedgerEntry]) -> LedgerFigures:
    """Lost: admitted, and its last event is neither trained, unfinished nor a drop as
    filtered (rollout.filter_groups: final). Trained twice: more than one trained event."""
    last: dict[str, str] = {}
    admitted: set[str] = set()
    trained: Counter[str] = Counter()
    for entry in entries:
        last[entry.prompt_id] = (FILTERED if (entry.event, entry.reason) == ("dropped", FILTERED)
                                 else entry.event)
        if entry.event == "admitted":
            admitted.add(entry.prompt_id)
        elif entry.event == "trained":
            trained[entry.prompt_id] += 1
    return LedgerFigures(
        admitted=len(admitted), trained=sum(trained.values()),
        unfinished=sum(1 for p in admitted if last[p] == "unfinished"),
        lost=sorted(p for p in admitted if last[p] not in ("trained", "unfinished", FILTERED)),
        trained_twice=sorted(p for p, n in trained.items() if n > 1))


def restarts_in(output: str) -> tuple[int, int]:
    """(rollout workers lost and being restarted, restarts completed) in a run's stdout."""
    return len(LOST.findall(output)), len(RESTARTED.findall(output))


def last_step(run_dir: Path) -> int:
    """The step of the newest metrics row (0 before the first)."""
    path = run_dir / METRICS
    lines = path.read_bytes().splitlines() if path.exists() else []
    match = re.search(rb'"step":(\d+)', lines[-1]) if lines else None
    return int(match.group(1)) if match else 0


def title(proc: psutil.Process) -> str:
    """A process's title (Ray rewrites argv[0] to ray::Class.method)."""
    with contextlib.suppress(psutil.Error):
        return (proc.cmdline() or [""])[0] or proc.name()
    return ""


class Attempt:
    """One ``async-rl train`` subprocess and its descendants (pid -> (start time, title))."""

    def __init__(self, number: int, cmd: list[str], out: Path, run_dir: Path) -> None:
        self.number, self.cmd, self.run_dir = number, cmd, run_dir
        self.stdout, self.stderr = out / f"attempt-{number}.out", out / f"attempt-{number}.err"
        checkpoints = (run_dir / "checkpoints").glob("step-*") if "--resume" in cmd else []
        self.start_step = max((int(c.name[5:]) for c in checkpoints), default=0)
        self.started = time.time()
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        with self.stdout.open("wb") as so, self.stderr.open("wb") as se:
            self.proc = subprocess.Popen(cmd, stdout=so, stderr=se, start_new_session=True,
                                         env=env)
        self.seen: dict[int, tuple[float, str]] = {}
        self.kills: list[str] = []

    def descendants(self) -> list[psutil.Process]:
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                self.seen.setdefault(p.pid, (p.create_time(), title(p)))
        return procs

    def output(self) -> str:
        return self.stdout.read_text(errors="replace")

    def ready(self) -> bool:
        """Workers up (workers.json written by this attempt) and a step logged since."""
        workers = self.run_dir / WORKERS
        return (workers.exists() and workers.stat().st_mtime >= self.started
                and last_step(self.run_dir) > self.start_step)

    def restart_pending(self) -> bool:
        lost, restarted = restarts_in(self.output())
        rollout_kills = sum(k.startswith(ROLLOUT) for k in self.kills)
        return lost < rollout_kills or restarted < lost

    def stop(self) -> None:
        """SIGKILL the session and every descendant seen (a timeout or Ctrl-C)."""
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        sigkill(self.leftovers(grace_s=0))
        self.proc.wait()

    def leftovers(self, grace_s: float) -> list[int]:
        """Descendants seen while it ran that still live (waiting up to ``grace_s``)."""
        deadline = time.monotonic() + grace_s
        while True:
            alive = [pid for pid, (created, _) in self.seen.items() if running(pid, created)]
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.5)

    def stderr_lines(self) -> list[str]:
        return self.stderr.read_text(errors="replace").splitlines()

    def failed_line(self) -> str:
        """The one line a failed run ends with ("" if none)."""
        return next((ln for ln in self.stderr_lines() if ln.startswith("run failed:")), "")


def running(pid: int, created: float) -> bool:
    """Process ``pid`` started at ``created`` still runs (not a zombie, not reused)."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def sigkill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def log(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {text}", flush=True)


def run_attempt(attempt: Attempt, schedule: list[Kill], t0: float, timeout_s: float
                ) -> int | None:
    """Watches one attempt, firing due kills; its exit status (None: timed out)."""
    due_at: float | None = None
    deadline = time.monotonic() + timeout_s
    while attempt.proc.poll() is None:
        if time.monotonic() > deadline:
            attempt.stop()
            return None
        procs = attempt.descendants()
        if schedule and attempt.ready() and not attempt.restart_pending():
            step = last_step(attempt.run_dir)
            kill = schedule[0]
            if step >= kill.step and due_at is None:
                due_at = time.monotonic() + kill.delay_s
            victims = sorted((p for p in procs if title(p).startswith(kill.target)),
                             key=lambda p: p.pid)
            if due_at is not None and time.monotonic() >= due_at and victims:
                due_at, victim = None, victims[int(kill.pick * len(victims))]
                name = title(victim)
                with contextlib.suppress(psutil.Error):
                    victim.send_signal(signal.SIGKILL)
                    attempt.kills.append(name)
                    schedule.pop(0)
                    log(t0, f"step {step}: SIGKILL {name} (pid {victim.pid}), due at step "
                            f"{kill.step}")
        time.sleep(0.3)
    return attempt.proc.returncode


def train_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    sets = [f"run.num_steps={args.steps}", f"run.output_dir={run_dir}",
            "run.progress=false", "run.eval_every=0", "task.eval_size=32",
            f"run.checkpoint_every={args.checkpoint_every}",
            f"rollout.max_restarts={args.kills + 3}", *args.overrides]
    return [sys.executable, "-m", "async_rl.cli", "train", args.config, "--overwrite",
            *(arg for s in sets for arg in ("--set", s))]


def reproduce(seed: int) -> str:
    """This command line, with its seed (the defaults are the same every time)."""
    argv = sys.argv[1:]
    argv = argv if any(a.startswith("--seed") for a in argv) else ["--seed", str(seed), *argv]
    return shlex.join(["python", "-m", "bench.reliability.chaos", *argv])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--steps", type=int, default=80, help="run.num_steps")
    parser.add_argument("--kills", type=int, default=4, help="rollout actor kills")
    parser.add_argument("--trainer-kill", action=argparse.BooleanOptionalAction, default=True,
                        help="kill the trainer actor once, then --resume")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="run.checkpoint_every")
    parser.add_argument("--config", default="examples/cpu_default.toml")
    parser.add_argument("--out", type=Path, help="default runs/chaos-seedN: run/ and logs")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per attempt")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="config override (repeatable)")
    args = parser.parse_args()
    args.out = args.out or Path(f"runs/chaos-seed{args.seed}")
    try:
        schedule = plan_kills(args.seed, args.steps, args.kills, args.trainer_kill,
                              args.checkpoint_every)
        config = check_inputs(load_config(args.config, args.overrides))
    except (ValueError, ConfigError) as err:
        print(f"chaos: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("attempt-*"):
        old.unlink()
    run_dir = args.out / "run"
    print("kill schedule: " + ", ".join(
        f"{k.target.removeprefix('ray::')}@{k.step}+{k.delay_s:.1f}s" for k in schedule))
    t0 = time.monotonic()
    cmd = train_command(args, run_dir)
    attempts: list[Attempt] = []
    leftovers: dict[int, str] = {}
    failure = ""
    while not failure:
        attempt = Attempt(len(attempts) + 1, cmd, args.out, run_dir)
        attempts.append(attempt)
        log(t0, f"attempt {attempt.number}: {shlex.join(cmd[2:])}")
        try:
            code = run_attempt(attempt, schedule, t0, args.timeout)
        finally:  # Ctrl-C: nothing of the run is left behind
            if attempt.proc.poll() is None:
                attempt.stop()
        log(t0, f"attempt {attempt.number} exited {code}")
        leftovers.update((pid, attempt.seen[pid][1]) for pid in attempt.leftovers(20))
        if code == 0:
            break
        if code == 1 and attempt.failed_line() and any(
                k.startswith(TRAINER) for k in attempt.kills):
            cmd = [sys.executable, "-m", "async_rl.cli", "train", "--resume", str(run_dir)]
            continue
        why = (f"timed out after {args.timeout:g} s" if code is None else f"exit {code}"
               + ("" if attempt.failed_line() else " without a 'run failed:' line"))
        failure = (f"attempt {attempt.number} {why}; its stderr ends:\n  "
                   + "\n  ".join(attempt.stderr_lines()[-12:]))
    wall_s = time.monotonic() - t0
    sigkill(leftovers)  # reported below; not left to hog the machine
    return report(args, config.trainer.groups_per_step, run_dir, attempts, leftovers,
                  wall_s, failure, schedule)


def report(args: argparse.Namespace, groups_per_step: int, run_dir: Path,
           attempts: list[Attempt], leftovers: dict[int, str], wall_s: float,
           failure: str, missed: list[Kill]) -> int:
    kills = [k for a in attempts for k in a.kills]
    rollout_kills = sum(k.startswith(ROLLOUT) for k in kills)
    groups = args.steps * groups_per_step
    try:
        summary, figures = read_summary(run_dir), ledger_figures(read_ledger(run_dir))
    except (OSError, ValueError) as err:
        print(f"no summary or ledger to read: {err}")
        summary, figures = None, LedgerFigures(0, 0, 0, [], [])
    restarts = sum(restarts_in(a.output())[0] for a in attempts)
    rows: list[tuple[str, object, object]] = [
        ("steps completed", summary.steps if summary else "-", args.steps),
        ("rollout kills / trainer kills", f"{rollout_kills} / {len(kills) - rollout_kills}",
         f"{args.kills} / {int(args.trainer_kill)}"),
        ("rollout restarts (all attempts)", restarts, rollout_kills),
        ("restarts in final summary.json", summary.restarts if summary else "-", ""),
        ("resumes", len(attempts) - 1, int(args.trainer_kill)),
        ("prompts admitted / unfinished", f"{figures.admitted} / {figures.unfinished}", ""),
        ("prompts lost", len(figures.lost), 0),
        ("prompts trained twice", len(figures.trained_twice), 0),
        ("trained groups (ledger / summary)",
         f"{figures.trained} / {summary.groups_trained if summary else '-'}", groups),
        ("run stopped early", repr(summary.stopped) if summary and summary.stopped else "no",
         "no"),
        ("processes left after the run", len(leftovers), 0),
        ("wall time (s)", f"{wall_s:.0f}", ""),
        ("training wall time (s)", f"{summary.wall_s:.0f}" if summary else "-", ""),
    ]
    ok = (not failure and not leftovers and not figures.lost and not figures.trained_twice
          and summary is not None and not summary.stopped and figures.trained
          == summary.groups_trained == summary.steps * groups_per_step == groups)
    table = Table(title=f"chaos benchmark, seed {args.seed}: {run_dir}")
    for column in ("figure", "value", "expected"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for name, value, expected in rows:
        table.add_row(name, str(value), str(expected))
    Console(width=max(100, Console().width)).print(table)
    for a in attempts:
        print(f"attempt {a.number}: exit {a.proc.returncode}, kills {a.kills}"
              + (f"\n  {a.failed_line()}" if a.failed_line() else ""))
    if missed:
        print("kills not done (the run ended first): " + ", ".join(
            f"{k.target.removeprefix('ray::')}@{k.step}" for k in missed))
    if figures.lost or figures.trained_twice:
        print(f"lost: {figures.lost[:10]}; trained twice: {figures.trained_twice[:10]}")
    if leftovers:
        print("left alive (now killed): " + ", ".join(f"{p} {t}" for p, t in leftovers.items()))
    if failure:
        print(f"benchmark failure: {failure}")
    print(("PASS" if ok else "FAIL") + f"; reproduce: {reproduce(args.seed)}")
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
