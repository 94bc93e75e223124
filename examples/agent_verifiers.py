"""A verifiers environment as the agent: each trajectory is one episode of
examples/verifiers_calculator.py, played by one verifiers process that serves every
trajectory of this process (docs/agents.md, "verifiers").

Owns ``solve`` (examples/agent_verifiers.toml names it) and the episode server behind it.
verifiers 0.4.0 cannot share async-rl's virtualenv (it pins ``openai<3`` and
``mcp==2.0.0``, below what vLLM uses), so it lives in one of its own, ``.venv-verifiers``
(``make verifiers``; ``ASYNC_RL_VERIFIERS_PYTHON`` names another interpreter with
verifiers installed). The first ``solve`` of this process (a rollout worker's) starts
that interpreter on the environment's script, which loads the environment once and then
plays each requested episode as an asyncio task of its own, all at once: the run bounds
them (rollout.max_inflight_prompts x group_size). They speak JSON lines over the
server's stdin and stdout: ``{"id", "base_url", "api_key", "row"}`` in, ``{"id",
"reward"}`` or ``{"id", "error"}`` out. Two threads of this process write the requests
and read the replies, each handed to the event loop of the ``solve`` awaiting it, so the
server belongs to no loop and a slow pipe never holds one.

- A ``solve`` cancelled (its trajectory cut at task.agent_timeout_s) sends
  ``{"cancel": id}``: the server cancels that episode and answers nothing.
- An episode that fails raises its error in ``solve``: an agent error for the run.
- A server that dies fails every ``solve`` awaiting it, with its exit status and last
  line of stderr; the next ``solve`` starts a fresh one.
- The server is killed, with anything it started, at this interpreter's exit
  (``kill_servers``), and ends by itself when its stdin does (this process died).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import itertools
import json
import logging
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import openai

PYTHON_VARIABLE = "ASYNC_RL_VERIFIERS_PYTHON"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = REPO / ".venv-verifiers" / "bin" / "python"
SCRIPT = Path(__file__).resolve().with_name("verifiers_calculator.py")
_DROPPED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
"""Variables of this process that would point the other interpreter at this one's
packages."""
log = logging.getLogger(__name__)
_ids = itertools.count()
_servers: dict[Path, Server] = {}  # the latest server of each script
_starting = threading.Lock()
_started = 0


def verifiers_python() -> Path:
    """The interpreter that has verifiers; ``FileNotFoundError`` saying how to make it."""
    python = Path(os.environ.get(PYTHON_VARIABLE) or DEFAULT_PYTHON)
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise FileNotFoundError(
            f"no verifiers virtualenv: {python} is not an interpreter; make it with "
            f"`make verifiers` (scripts/setup-verifiers.sh), or set {PYTHON_VARIABLE} to "
            f"a python that has verifiers==0.4.0")
    return python


def starts() -> int:
    """How many episode servers this process has started."""
    return _started


class Server:
    """One episode server process, the replies it owes, and the threads that talk to it."""

    def __init__(self, python: Path, script: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
        self.process = subprocess.Popen(
            [str(python), str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=env, start_new_session=True)
        self.pid = self.process.pid
        self._lock = threading.Lock()  # guards _pending and _gone
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[float]]] = {}
        self._gone: str | None = None  # why it ended, once it has
        self._stopped = False  # killed on purpose: its end is no news
        self._requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=20)
        self._drain = self._thread(self._read_stderr, "stderr")
        self._thread(self._write, "requests")
        self._thread(self._read, "replies")

    def _thread(self, target: Any, what: str) -> threading.Thread:
        thread = threading.Thread(target=target, daemon=True,
                                  name=f"verifiers-server-{self.pid}-{what}")
        thread.start()
        return thread

    @property
    def alive(self) -> bool:
        return self._gone is None and self.process.poll() is None

    async def episode(self, client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
        """The reward of one episode of ``row`` in ``client``'s session."""
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[float] = loop.create_future()
        key = next(_ids)
        with self._lock:
            if self._gone is not None:
                raise RuntimeError(self._gone)
            self._pending[key] = (loop, reply)
        try:
            self._send({"id": key, "base_url": str(client.base_url),
                        "api_key": client.api_key, "row": row})
            return await reply
        except asyncio.CancelledError:
            if self.alive:
                self._send({"cancel": key})
            raise
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def _send(self, message: dict[str, Any]) -> None:
        self._requests.put((json.dumps(message) + "\n").encode())

    def _write(self) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        while (data := self._requests.get()) is not None:
            try:
                stdin.write(data)
                stdin.flush()
            except (OSError, ValueError):  # it died: the reader says so
                return

    def _read(self) -> None:
        """Hands each reply to its episode; when the server's stdout ends (it died, or
        was killed), fails every episode it owed."""
        stdout = self.process.stdout
        assert stdout is not None
        why = "exited"
        try:
            for line in stdout:
                self._route(line)
        except (OSError, ValueError) as err:
            why = f"stopped ({err!r})"
        try:
            self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:  # it closed stdout and lives on
            self.kill()
            self.process.wait()
        self._drain.join(timeout=2.0)  # its last words
        self._requests.put(None)
        last = self._stderr[-1][-300:] if self._stderr else "no output"
        with self._lock:
            self._gone = (f"the verifiers episode server (pid {self.pid}) {why} with status "
                          f"{self.process.returncode}: {last}")
            owed, self._pending = list(self._pending.values()), {}
        log.log(logging.DEBUG if self._stopped else logging.WARNING,
                "%s; the next episode starts another", self._gone)
        for loop, reply in owed:
            _hand(loop, reply, RuntimeError(self._gone))

    def _route(self, line: bytes) -> None:
        try:
            message = json.loads(line)
            key = message["id"]
        except (ValueError, TypeError, KeyError):
            log.warning("the verifiers episode server wrote %r", line[:200])
            return
        with self._lock:
            waiting = self._pending.get(key)
        if waiting is None:
            return  # cancelled meanwhile
        if "error" in message:
            outcome: float | Exception = RuntimeError(
                f"the verifiers episode failed: {message['error']}")
        elif isinstance(message.get("reward"), int | float):
            outcome = float(message["reward"])
        else:
            outcome = RuntimeError(f"the verifiers episode server replied no reward: "
                                   f"{line[:200]!r}")
        _hand(*waiting, outcome)

    def _read_stderr(self) -> None:
        stderr = self.process.stderr
        assert stderr is not None
        for line in stderr:
            text = line.decode(errors="replace").rstrip()
            if text:
                self._stderr.append(text)
                log.debug("verifiers episode server: %s", text)

    def kill(self) -> None:
        """Kills the server and what it started (its own session: one process group)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)


def _hand(loop: asyncio.AbstractEventLoop, reply: asyncio.Future[float],
          outcome: float | Exception) -> None:
    """Settles ``reply`` with ``outcome`` on its loop (from a server's thread)."""
    def settle() -> None:
        if reply.done():
            return
        if isinstance(outcome, Exception):
            reply.set_exception(outcome)
        else:
            reply.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
        loop.call_soon_threadsafe(settle)


def server(script: Path = SCRIPT) -> Server:
    """This process's server of ``script``, started when it has none alive."""
    global _started
    python = verifiers_python()
    with _starting:
        running = _servers.get(script)
        if running is None or not running.alive:
            running = _servers[script] = Server(python, script)
            _started += 1
            log.info("started the verifiers episode server (pid %d): %s",
                     running.pid, script)
        return running


async def episode(client: openai.AsyncOpenAI, row: dict[str, Any],
                  script: Path = SCRIPT) -> float:
    """The reward of one episode of ``row`` in ``client``'s session, played by this
    process's server of ``script``. Raises when the episode or the server fails."""
    return await server(script).episode(client, row)


@atexit.register
def kill_servers() -> None:
    """Kills every episode server of this process, and waits for each to end."""
    for running in list(_servers.values()):
        running._stopped = True
        running.kill()
    for running in list(_servers.values()):
        with contextlib.suppress(subprocess.TimeoutExpired):
            running.process.wait(timeout=5.0)


async def solve(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    """The episode's reward: 1 when the model's final ``#### value`` is the row's."""
    return await episode(client, row)
