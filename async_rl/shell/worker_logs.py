"""Where the worker processes' output goes: RUN_DIR/workers.log, and warnings to the console.

Owns: the ``ray.init`` options that install ``route_output`` in every worker process of
a run, the relay it starts, and the filter that moves Ray's token-authentication notice
from the driver's console to the same file (``ray_notices_to_log``). The relay gets
everything the worker and the processes it spawns (vLLM's engine core and engine
worker) write to stdout and stderr: vLLM's logs, C++ warnings, Python warnings, progress
bars, prints, tracebacks. Every line goes to RUN_DIR/workers.log; warnings and errors
(each distinct message once per worker) and tracebacks go on to the worker's original
stderr, which Ray prints on the driver's console, except the known-benign warnings of
``BENIGN_WARNINGS``. With ``verbose`` every line goes on. Knows nothing about what the workers do.

The relay is a process of its own, not a thread, so that what a dying worker writes
last (a fatal error, a traceback) still reaches the log and the console.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, NamedTuple

LOG_ENV = "ASYNC_RL_WORKERS_LOG"
"""Absolute path of the run's workers.log, set in the workers' environment."""
VERBOSE_ENV = "ASYNC_RL_WORKERS_VERBOSE"
"""1: the relay passes every line to the console, not only warnings and errors."""

RAY_MARKERS = (":actor_name:", ":task_name:", ":job_id:")
"""Lines Ray's log monitor reads to name a worker's output ("(RolloutActor pid=...)")
and never prints (ray/_private/ray_constants.py LOG_PREFIX_*): always passed on."""


class Benign(NamedTuple):
    """A warning that reads like a failure but is not one: workers.log only."""

    pattern: re.Pattern[str]
    why: str


BENIGN_WARNINGS = (
    Benign(re.compile(r"\b(RotaryEmbedding|ParallelLMHead): Failed to load weights\s*$"),
           "vLLM's layerwise reload (model_loader/reload/layerwise.py) warns for every "
           "module that got no tensor from a weight update. These two never get one: "
           "the rotary embedding's cos/sin cache is computed, not a weight, and a tied "
           "LM head is the embedding matrix, loaded as embed_tokens (an untied head gets "
           "lm_head.weight in every update). Any other module failing to load still "
           "reaches the console."),
    Benign(re.compile(r"\blib(tcmalloc|iomp) is not found in LD_PRELOAD\b"),
           "vLLM's CPU worker (v1/worker/cpu_worker.py) asks for tcmalloc and Intel's "
           "OpenMP for speed, not correctness. workers.rollout.engine.preload_cpu_libs "
           "preloads them where they are installed; docs/operations.md says how to get "
           "them."),
    Benign(re.compile(r"\bEnforce eager set, disabling torch\.compile|\bInductor compilation "
                      r"was disabled by user settings"),
           "workers.rollout.engine.build_engine sets enforce_eager on purpose (no "
           "torch.compile, CUDA graphs or JIT warm-up when an engine starts); vLLM "
           "restates that choice at every engine start."),
    Benign(re.compile(r"\bTriton is not installed\. triton-cpu is expected\b|\bModel Runner "
                      r"V2 requires Triton; using the V1 model runner\b"),
           "vLLM's CPU build would use triton-cpu for a few kernels and its second model "
           "runner; no registry ships triton-cpu for it, and vLLM falls back to its own "
           "CPU kernels and the V1 runner, which every figure in docs/ was measured on."),
    Benign(re.compile(r"\bReset SSM cache type to float32 for accelerated GDN mamba\b"),
           "vLLM's CPU platform sets the state cache of Mamba-style layers at every start; "
           "the models this project runs have none."),
    Benign(re.compile(r"\bThe global random seed is set to \d+\. Since "
                      r"VLLM_ENABLE_V1_MULTIPROCESSING is set to False\b"),
           "vLLM seeds the rollout worker's global generators because the engine runs "
           "with V1 multiprocessing off (rollout.model_in_engine_core). The worker draws "
           "nothing from them: every sample request carries its own seed "
           "(workers.rollout.continuation.request_seed)."),
    Benign(re.compile(r"FutureWarning: `torch\.distributed\.reduce_op` is deprecated"),
           "vLLM's Triton dispatcher (vllm/triton_utils/dispatcher.py) scans the attributes "
           "of every loaded module when an engine starts, and merely reading "
           "torch.distributed.reduce_op, an alias torch keeps for old code, warns. Neither "
           "vLLM nor this project uses it."),
    Benign(re.compile(r"Warning: NUMA binding: Using MEMBIND policy for memory allocation"),
           "vLLM's CPU worker (init_cpu_memory_env, in C++) binds the engine's memory to "
           "the NUMA node of the cores the layout gave it, as it should, and says so at "
           "every engine start."),
    Benign(re.compile(r"\[shutdown\] Process manager: force killing remaining process"),
           "At the end of a run the rollout worker stops its engine and is then killed "
           "itself: an engine core still tearing down when vLLM's shutdown wait ends is "
           "killed a moment early, with nothing left to lose."),
)
"""The one place that keeps warnings off the console, each with why it is benign."""

_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_PROBLEM = re.compile(r"\w*(Warning|Error|Exception)\b")  # FutureWarning:, ValueError:, glog
_ORIGIN = re.compile(r"^\([\w-]+ pid=\d+\) ")  # vLLM's "(EngineCore pid=12) " prefix


def ray_options(log_path: str | Path, verbose: bool) -> dict[str, Any]:
    """Keyword arguments for ``ray.init``: route worker output through the relay.

    Starts an empty ``log_path``. Ray's own INFO lines on the driver ("Started a local
    Ray instance") are hidden too unless ``verbose``.
    """
    path = Path(log_path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return {
        "runtime_env": {
            "worker_process_setup_hook": f"{__name__}.route_output",
            "env_vars": {LOG_ENV: str(path), VERBOSE_ENV: "1" if verbose else "0"},
        },
        "logging_level": logging.INFO if verbose else logging.WARNING,
    }


RAY_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"
"""Ray's notice, at every start of a local Ray, that token authentication is on and how
to turn it off (ray/_private/authentication/authentication_token_setup.py)."""


class RayNoticesToLog(logging.Filter):
    """Takes Ray's token-authentication notice off the driver's console into workers.log.

    Installed on the logger that emits it, where it is emitted: authentication stays on
    (a run's local Ray is reachable only from this machine, with the token), the notice
    asks nothing of the user, and any other record of that logger (a warning that
    authentication is off, say) still reaches the console."""

    def __init__(self, log_path: str | Path) -> None:
        super().__init__()
        self.log_path = Path(log_path)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(RAY_AUTH_NOTICE):
            return True
        with open(self.log_path, "a") as log:  # the relays append to it too
            log.write(f"(driver) {record.levelname} {record.name}: {message}\n")
        return False


def ray_notices_to_log(log_path: str | Path, verbose: bool) -> None:
    """Installs ``RayNoticesToLog`` for this run's workers.log (replacing an earlier
    run's in this process); with ``verbose`` the notice stays on the console."""
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    for old in [f for f in logger.filters if isinstance(f, RayNoticesToLog)]:
        logger.removeFilter(old)
    if not verbose:
        logger.addFilter(RayNoticesToLog(log_path))


def route_output() -> None:
    """Ray's worker setup hook: this process's stdout and stderr go through the relay."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    # The relay writes on to the file Ray tails for this worker; it inherits only the
    # pipe's read end, so it sees end-of-file once every writer has exited.
    subprocess.Popen([sys.executable, "-m", __name__, path, str(os.getpid())],
                     stdin=read, stdout=2, stderr=2, close_fds=True)
    os.close(read)
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(write)


class LineRouter:
    """Decides, line by line, what of a worker's output also goes to the console."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.seen: set[str] = set()
        self.in_traceback = False

    def for_console(self, line: str) -> bool:
        if self.verbose or line.startswith(RAY_MARKERS):
            return True
        if line.startswith("Traceback (most recent call last)"):
            self.in_traceback = True
            return True
        if self.in_traceback:
            # Frames are indented; the first unindented line is the exception itself.
            self.in_traceback = line[:1].isspace()
            return True
        level = _LEVEL.search(line)
        if level is None and not _PROBLEM.search(line):
            return False
        if level is not None and level.group(1) in ("DEBUG", "INFO"):
            return False
        if any(benign.pattern.search(line) for benign in BENIGN_WARNINGS):
            return False
        # The same warning every weight update is shown once; workers.log has them all.
        key = re.sub(r"\d+", "#", _ORIGIN.sub("", line))
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def relay(source: IO[bytes], log: IO[bytes], console: IO[bytes], pid: str,
          router: LineRouter) -> None:
    """Copies ``source`` line by line to ``log`` (prefixed with the worker's name and
    pid; Ray's markers left out) and the lines ``router`` picks to ``console``, until
    end-of-file."""
    origin = f"(pid={pid}) "
    for raw in source:
        line = raw.decode(errors="replace")
        if line.startswith(RAY_MARKERS[0]):
            origin = f"({line[len(RAY_MARKERS[0]):].strip()} pid={pid}) "
        if not line.startswith(RAY_MARKERS):
            log.write(origin.encode() + raw)
            log.flush()
        if router.for_console(line):
            console.write(raw)
            console.flush()


def main() -> None:
    # Ctrl-C stops the run; the relay must still drain what the workers write last.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log_path, pid = sys.argv[1], sys.argv[2]
    # On a multi-node cluster the driver's path is made on each node for its workers.
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        relay(sys.stdin.buffer, log, sys.stdout.buffer, pid,
              LineRouter(verbose=os.environ.get(VERBOSE_ENV) == "1"))


if __name__ == "__main__":
    main()
