"""A verifiers environment as the agent: each trajectory is one episode of
examples/verifiers_calculator.py, run by verifiers in a process of its own
(docs/agents.md, "verifiers").

examples/agent_verifiers.toml names ``solve``. verifiers 0.4.0 cannot share async-rl's
virtualenv (it pins ``openai<3`` and ``mcp==2.0.0``, below what vLLM uses), so it lives
in one of its own, ``.venv-verifiers`` (``make verifiers``), and ``solve`` starts that
virtualenv's python on the environment's script with the trajectory's session in
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` and the row as JSON on stdin; the script prints
the episode's reward as its last line. A process that fails, prints no reward or
outlives the trajectory (cancelled at task.agent_timeout_s) is killed, with anything it
started; the first two raise, so the run counts an agent error.

Each episode's process costs about 7 s of CPU (most of it importing verifiers) and 230 MB
(one shared 2-core machine), so at most ``ASYNC_RL_VERIFIERS_PROCESSES`` run at once in a
rollout worker (default: two per core it may use), the others waiting their turn within
their trajectory's agent_timeout_s: an evaluation starts all its trajectories at once.
``ASYNC_RL_VERIFIERS_PYTHON`` names another interpreter with verifiers installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import weakref
from pathlib import Path
from typing import Any

import openai

PYTHON_VARIABLE = "ASYNC_RL_VERIFIERS_PYTHON"
PROCESSES_VARIABLE = "ASYNC_RL_VERIFIERS_PROCESSES"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = REPO / ".venv-verifiers" / "bin" / "python"
SCRIPT = Path(__file__).resolve().with_name("verifiers_calculator.py")
_DROPPED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
"""Variables of this process that would point the other interpreter at this one's
packages."""
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary())


def processes_at_once() -> int:
    """How many episode processes may run at once (``ASYNC_RL_VERIFIERS_PROCESSES``,
    else two per core this process may use)."""
    return int(os.environ.get(PROCESSES_VARIABLE) or 2 * len(os.sched_getaffinity(0)))


def _slot() -> asyncio.Semaphore:
    """The running loop's bound on episode processes (the agents' loop: one a worker)."""
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots[loop] = asyncio.Semaphore(processes_at_once())
    return _slots[loop]


def verifiers_python() -> Path:
    """The interpreter that has verifiers; ``FileNotFoundError`` saying how to make it."""
    python = Path(os.environ.get(PYTHON_VARIABLE) or DEFAULT_PYTHON)
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise FileNotFoundError(
            f"no verifiers virtualenv: {python} is not an interpreter; make it with "
            f"`make verifiers` (scripts/setup-verifiers.sh), or set {PYTHON_VARIABLE} to "
            f"a python that has verifiers==0.4.0")
    return python


def session_env(client: openai.AsyncOpenAI) -> dict[str, str]:
    """This process's environment with ``client``'s session in the variables the
    ``openai`` client reads."""
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
    return {**env, "OPENAI_BASE_URL": str(client.base_url), "OPENAI_API_KEY": client.api_key}


def _kill(process: asyncio.subprocess.Process) -> None:
    """Kills ``process`` and what it started (its own session: one process group)."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


def reward_of(stdout: bytes) -> float:
    """The reward the episode printed as its last line; ``ValueError`` when none."""
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        return float(lines[-1])
    except (IndexError, ValueError):
        raise ValueError(f"the verifiers episode printed no reward (its output ended "
                         f"{lines[-1][-200:] if lines else 'empty'!r})") from None


async def episode(client: openai.AsyncOpenAI, row: dict[str, Any],
                  script: Path = SCRIPT) -> float:
    """Runs ``script`` on ``row`` in the verifiers interpreter against ``client``'s
    session; its reward. Raises when it fails or prints none; killed when cancelled."""
    python = verifiers_python()
    async with _slot():
        return await _run(python, script, client, row)


async def _run(python: Path, script: Path, client: openai.AsyncOpenAI, row: dict[str, Any]
               ) -> float:
    process = await asyncio.create_subprocess_exec(
        str(python), str(script), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=session_env(client), start_new_session=True)
    try:
        stdout, stderr = await process.communicate(json.dumps(row).encode())
    finally:
        _kill(process)  # at once, before any await: cancelled, or out of time
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(process.wait(), 5.0)
    if process.returncode != 0:
        last = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"the verifiers episode exited with status "
                           f"{process.returncode}: {last[0][-300:]}")
    return reward_of(stdout)


async def solve(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    """The episode's reward: 1 when the model's final ``#### value`` is the row's."""
    return await episode(client, row)
