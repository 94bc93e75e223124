"""The quiet console: a worker's output all goes to workers.log; only warnings (each once),
errors, tracebacks and Ray's markers go on to the console, unless verbose."""

from __future__ import annotations

import logging
import logging.handlers
import os
import subprocess
import sys
import textwrap
from io import BytesIO
from pathlib import Path

from async_rl.shell.worker_logs import (
    BENIGN_WARNINGS,
    LOG_ENV,
    VERBOSE_ENV,
    LineRouter,
    ray_notices_to_log,
    ray_options,
    relay,
)

VLLM_INFO = "(EngineCore pid=12) INFO 11-30 18:51:33 [core.py:133] Initializing a V1 LLM engine"
VLLM_WARNING = "(Worker pid=13) WARNING 11-30 18:51:48 [layerwise.py:266] RotaryEmbedding: Failed"


def test_router_shows_warnings_once_and_hides_info() -> None:
    router = LineRouter(verbose=False)
    assert not router.for_console(VLLM_INFO)
    assert not router.for_console("Loading weights: 100%|##########| 50/50")
    assert router.for_console(VLLM_WARNING)
    # The same warning from the next weight update (new time, same message): not again.
    assert not router.for_console(VLLM_WARNING.replace("18:51:48", "18:52:07"))
    assert router.for_console(VLLM_WARNING.replace("RotaryEmbedding", "ParallelLMHead"))
    assert router.for_console("x.py:138: FutureWarning: `reduce_op` is deprecated")
    assert router.for_console("[W1130 18:51:41.93 utils.cpp:68] Warning: NUMA binding")
    assert router.for_console("(EngineCore pid=12) ERROR 11-30 [core.py:9] engine died")
    assert not router.for_console("(EngineCore pid=12) INFO 11-30 [x.py:1] no Error here")
    assert router.for_console(":actor_name:RolloutWorker")


def test_router_shows_a_whole_traceback() -> None:
    router = LineRouter(verbose=False)
    lines = ["Traceback (most recent call last):", '  File "a.py", line 1, in <module>',
             "    run()", "RuntimeError: every rollout worker is gone"]
    assert [router.for_console(line) for line in lines] == [True] * 4
    assert not router.for_console("after the traceback, an ordinary line")


def test_verbose_shows_everything() -> None:
    router = LineRouter(verbose=True)
    assert router.for_console(VLLM_INFO) and router.for_console(VLLM_INFO)


BENIGN = [
    "(EngineCore pid=12) WARNING 12-01 21:16:32 [layerwise.py:266] RotaryEmbedding: Failed "
    "to load weights",
    "(EngineCore pid=12) WARNING 12-01 21:16:32 [layerwise.py:266] ParallelLMHead: Failed "
    "to load weights",
    "(EngineCore pid=12) WARNING 12-01 21:16:19 [cpu_worker.py:114] libtcmalloc is not "
    "found in LD_PRELOAD. For best performance, please follow the section `set LD_PRELOAD`",
    "(EngineCore pid=12) WARNING 12-01 21:16:19 [cpu_worker.py:114] libiomp is not found "
    "in LD_PRELOAD. For best performance, please follow the section `set LD_PRELOAD`",
    "(MainProcess pid=12) WARNING 12-04 00:16:22 [vllm.py:1703] Enforce eager set, "
    "disabling torch.compile, CUDAGraphs, and JIT kernel warmup.",
    "(MainProcess pid=12) WARNING 12-04 00:16:22 [vllm.py:1727] Inductor compilation was "
    "disabled by user settings, optimizations settings that are only active during",
    "(MainProcess pid=12) WARNING 12-04 00:16:22 [cpu.py:224] Triton is not installed. "
    "triton-cpu is expected on x86 CPUs.",
    "(MainProcess pid=12) WARNING 12-04 00:16:22 [vllm.py:725] Model Runner V2 requires "
    "Triton; using the V1 model runner instead.",
    "(MainProcess pid=12) WARNING 12-04 00:16:22 [cpu.py:317] Reset SSM cache type to "
    "float32 for accelerated GDN mamba backend 'none'.",
    "(MainProcess pid=12) WARNING 12-04 00:16:22 [arg_utils.py:1945] The global random seed "
    "is set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, this may affect",
    "(MainProcess pid=12) WARNING 12-02 02:39:13 [utils.py:648] [shutdown] Process "
    "manager: force killing remaining processes count=1",
    "(MainProcess pid=12) WARNING 12-02 02:39:13 [utils.py:653] [shutdown] Process "
    "manager: force killing remaining process EngineCore pid 21891",
    "/x/.venv/lib/python3.11/site-packages/vllm/triton_utils/dispatcher.py:138: "
    "FutureWarning: `torch.distributed.reduce_op` is deprecated, please use "
    "`torch.distributed.ReduceOp` instead",
    "[W1205 01:00:49.118693095 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy "
    "for memory allocation on the NUMA nodes (0). Memory allocations will be strictly "
    "bound to these NUMA nodes. (function init_cpu_memory_env)",
]


def test_benign_warnings_stay_off_the_console() -> None:
    router = LineRouter(verbose=False)
    assert [router.for_console(line) for line in BENIGN] == [False] * len(BENIGN)
    # A module that really failed to load is not benign; nor is any other warning.
    assert router.for_console(BENIGN[0].replace("RotaryEmbedding", "QKVParallelLinear"))
    assert router.for_console("(EngineCore pid=12) WARNING [x.py:1] libfoo is not found")
    assert all(benign.why for benign in BENIGN_WARNINGS)
    assert all(LineRouter(verbose=True).for_console(line) for line in BENIGN)


def test_benign_warnings_reach_the_log_only() -> None:
    real = "(EngineCore pid=12) WARNING 12-01 21:16:40 [core.py:9] KV cache is nearly full"
    source = BytesIO("".join(f"{line}\n" for line in [*BENIGN, real]).encode())
    log, console = BytesIO(), BytesIO()
    relay(source, log, console, "12", LineRouter(verbose=False))
    assert console.getvalue().decode().splitlines() == [real]
    assert log.getvalue().decode().splitlines() == [f"(pid=12) {line}"
                                                    for line in [*BENIGN, real]]


def test_ray_options_start_an_empty_log(tmp_path: Path) -> None:
    log = tmp_path / "run" / "workers.log"
    options = ray_options(log, verbose=False)
    assert log.read_bytes() == b""
    env = options["runtime_env"]["env_vars"]
    assert env == {LOG_ENV: str(log.resolve()), VERBOSE_ENV: "0"}
    assert options["runtime_env"]["worker_process_setup_hook"] == (
        "async_rl.shell.worker_logs.route_output")


WORKER = textwrap.dedent(f"""
    import os, subprocess, sys
    from async_rl.shell.worker_logs import route_output
    route_output()
    print(":actor_name:RolloutWorker", flush=True)
    print({VLLM_INFO!r}, flush=True)
    print({VLLM_WARNING!r}, file=sys.stderr, flush=True)
    print({VLLM_WARNING!r}, file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-c",
                    "import sys; print('(EngineCore pid=14) WARNING from the engine', "
                    "file=sys.stderr)"], check=True)
    os.write(2, b"[W1130 utils.cpp:68] Warning: written to the fd, not by Python\\n")
    print("Traceback (most recent call last):", file=sys.stderr)
    print("RuntimeError: the last words of a dying worker", file=sys.stderr, flush=True)
    os._exit(1)
""")


def run_worker(tmp_path: Path, verbose: bool) -> tuple[str, str]:
    """A process set up as Ray would (the hook first), and what reached its stderr."""
    log = tmp_path / "workers.log"
    env = {**os.environ, **ray_options(log, verbose)["runtime_env"]["env_vars"]}
    # Its stderr closes only when the relay, its last holder, has drained the pipe.
    done = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    return done.stderr, log.read_text()


def test_worker_output_is_routed(tmp_path: Path) -> None:
    console, log = run_worker(tmp_path, verbose=False)
    assert console.splitlines() == [
        ":actor_name:RolloutWorker", VLLM_WARNING,
        "(EngineCore pid=14) WARNING from the engine",
        "[W1130 utils.cpp:68] Warning: written to the fd, not by Python",
        "Traceback (most recent call last):",
        "RuntimeError: the last words of a dying worker",
    ]
    lines = log.splitlines()
    assert len(lines) == 7  # everything but Ray's marker, the repeat included
    prefix = "(RolloutWorker pid="
    assert all(line.startswith(prefix) for line in lines)
    assert lines[0].endswith(VLLM_INFO) and lines[-1].endswith("dying worker")


def test_verbose_worker_output_reaches_the_console(tmp_path: Path) -> None:
    console, log = run_worker(tmp_path, verbose=True)
    assert VLLM_INFO in console.splitlines()
    assert console.count(VLLM_WARNING) == 2
    assert len(log.splitlines()) == 7


def test_rays_authentication_notice_goes_to_the_log_not_the_console(tmp_path: Path) -> None:
    """Authentication stays on; its notice moves to workers.log, any other record of
    that logger still reaches the console, and a later run's filter replaces this one."""
    log_path = tmp_path / "workers.log"
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    console = logging.handlers.BufferingHandler(100)
    logger.addHandler(console)
    try:
        ray_notices_to_log(tmp_path / "earlier.log", verbose=False)
        ray_notices_to_log(log_path, verbose=False)
        logger.warning("Token authentication is enabled for this Ray cluster. Set "
                       "RAY_AUTH_MODE=disabled to opt out.")
        logger.warning("Token authentication is disabled for this Ray cluster.")
        assert [r.getMessage() for r in console.buffer] == [
            "Token authentication is disabled for this Ray cluster."]
        (line,) = log_path.read_text().splitlines()
        assert line.startswith("(driver) WARNING ray._private.authentication")
        assert "Token authentication is enabled" in line
        assert not (tmp_path / "earlier.log").exists()
        ray_notices_to_log(log_path, verbose=True)  # verbose: every line on the console
        logger.warning("Token authentication is enabled for this Ray cluster.")
        assert len(console.buffer) == 2 and len(log_path.read_text().splitlines()) == 1
    finally:
        logger.removeHandler(console)
        ray_notices_to_log(log_path, verbose=True)
