"""run.stop_signal: a scheduler's early-warning signal stops a run as Ctrl-C does.

The signal is really sent to this process and caught by ``StopSignals`` (no Ray: the
orchestrator it asks to stop is a stand-in that records the request); a bad name exits
2 naming the key; the run's exit status is 128 + the signal's number. A process started
while ``sigterm_blocked`` (Ray's, by a run) keeps a SIGTERM pending until SIGKILL, and
the starting thread's own mask is as it was.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from async_rl.cli import main, stop_exit
from async_rl.shell.ray_shell import StopSignals, sigterm_blocked

GOOD = '[model]\npath = "m"\n'


class RecordsStops:
    """Stands in for the orchestrator: the stop requests it got."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    def request_stop(self, reason: str) -> None:
        self.requests.append(reason)


def _send_while_watching(stops: StopSignals, *signums: int) -> None:
    async def run() -> None:
        with anyio.CancelScope() as scope:
            stops.run = scope
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(stops.watch)
                await anyio.sleep(0.05)  # the receiver is installed
                for signum in signums:
                    os.kill(os.getpid(), signum)
                    await anyio.sleep(0.05)
                tasks.cancel_scope.cancel()

    anyio.run(run)


def test_the_stop_signal_asks_for_a_clean_stop_as_sigint_does() -> None:
    stops, orchestrator = StopSignals("SIGUSR1"), RecordsStops()
    stops.orchestrator = orchestrator  # type: ignore[assignment]
    _send_while_watching(stops, signal.SIGUSR1)
    assert stops.received == [signal.SIGUSR1]
    assert orchestrator.requests == ["SIGUSR1"]


def test_a_second_signal_after_the_stop_signal_stops_at_once() -> None:
    stops, orchestrator = StopSignals("SIGUSR2"), RecordsStops()
    stops.orchestrator = orchestrator  # type: ignore[assignment]
    _send_while_watching(stops, signal.SIGUSR2, signal.SIGINT)
    assert stops.received == [signal.SIGUSR2, signal.SIGINT]
    assert orchestrator.requests == ["SIGUSR2"]  # the second cancelled the run's scope


def test_without_a_stop_signal_only_sigint_and_sigterm_are_watched() -> None:
    assert StopSignals().signals == (signal.SIGINT, signal.SIGTERM)
    assert StopSignals("SIGUSR1").signals == (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@pytest.mark.parametrize(("stopped_by", "status"), [
    ("SIGINT", 130), ("SIGTERM", 143), ("SIGUSR1", 138), ("SIGUSR2", 140),
    ("stop_timeout", 1), ("", 1),
])
def test_a_stopped_run_exits_128_plus_the_signals_number(stopped_by: str,
                                                         status: int) -> None:
    assert stop_exit(stopped_by) == status


@pytest.mark.parametrize("name", ["SIGKILL", "USR1", "SIGFOO", "SIGINT"])
def test_a_stop_signal_that_cannot_be_caught_or_is_unknown_exits_2_naming_the_key(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(GOOD)
    assert main(["config", "show", str(path), "--set", f'run.stop_signal="{name}"']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.stop_signal" in err and name in err


def test_a_process_started_with_sigterm_blocked_keeps_it_pending_until_sigkill() -> None:
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with sigterm_blocked():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
        child.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert child.poll() is None  # pending, not acted on
        status = dict(line.split(":\t", 1) for line in
                      Path(f"/proc/{child.pid}/status").read_text().splitlines()
                      if ":\t" in line)
        assert int(status["SigBlk"], 16) & (1 << (signal.SIGTERM - 1))
        assert int(status["ShdPnd"], 16) & (1 << (signal.SIGTERM - 1))
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
