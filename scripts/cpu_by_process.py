"""CPU-seconds by process kind while a command runs: where a test tier's CPU goes.

    python scripts/cpu_by_process.py -- python -m pytest tests/integration -q -n 2 \
        --dist loadscope --no-loadscope-reorder

Runs the command, samples every process started after it began (psutil, each
``--interval`` seconds), keeps each process's last CPU time (user + system), and when
the command ends prints the sums by kind, largest first, with how many processes each
kind had: a vLLM engine core, a Ray actor by its class (named by its last command line: a
Ray worker is "starting" until it takes its actor), a Ray worker waiting for work,
Ray's own processes, pytest. A process that lives less than an interval may be missed, so
the total is a lower bound. Exits with the command's status.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter, defaultdict

import psutil

RAY_OWN = ("gcs_server", "raylet", "log_monitor.py", "monitor.py", "dashboard.py",
           "dashboard/agent.py", "runtime_env/agent")
"""Ray's own processes, by a part of their command line."""


def kind(cmdline: str) -> str:
    """What a process is, from its command line (ray:: and VLLM:: names as they set them)."""
    if "EngineCore" in cmdline or "multiprocessing.spawn" in cmdline:
        return "vLLM engine core"
    if cmdline.startswith("ray::"):
        name = cmdline.split()[0].removeprefix("ray::").split(".")[0]
        return "ray worker waiting for work" if name == "IDLE" else f"ray actor {name}"
    if "default_worker.py" in cmdline:
        return "ray worker starting"
    if any(part in cmdline for part in RAY_OWN):
        return "ray's own processes"
    if "pytest" in cmdline:
        return "pytest"
    return cmdline.split()[0].rsplit("/", 1)[-1] if cmdline else "?"


def sample(seen: dict[tuple[int, float], tuple[str, float]], since: float) -> None:
    """Adds every process started since ``since`` to ``seen``: (pid, start) -> (kind,
    CPU-seconds so far)."""
    for process in psutil.process_iter(["pid", "cmdline", "cpu_times", "create_time"]):
        info = process.info
        if info["create_time"] is None or info["create_time"] < since or not info["cpu_times"]:
            continue
        key = (info["pid"], info["create_time"])
        cpu = info["cpu_times"].user + info["cpu_times"].system
        # A process is named by its last command line: a Ray worker starts as
        # default_worker.py and takes its actor's name (ray::RolloutActor) later.
        name = kind(" ".join(info["cmdline"] or []))
        if name == "?" and key in seen:  # exiting: its command line is gone
            name = seen[key][0]
        seen[key] = (name, cpu)


def table(seen: dict[tuple[int, float], tuple[str, float]]) -> list[str]:
    """The sums by kind, largest first, and the total."""
    cpu: dict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    for name, seconds in seen.values():
        cpu[name] += seconds
        count[name] += 1
    lines = [f"{seconds:9.1f} CPU-s  {count[name]:4d} x  {name}"
             for name, seconds in sorted(cpu.items(), key=lambda item: -item[1])]
    return [*lines, f"{sum(cpu.values()):9.1f} CPU-s  total"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("command", nargs="+", help="the command (after --)")
    args = parser.parse_args()
    since = time.time() - 1
    seen: dict[tuple[int, float], tuple[str, float]] = {}
    child = subprocess.Popen(args.command)
    while child.poll() is None:
        sample(seen, since)
        time.sleep(args.interval)
    sample(seen, since)
    print("\n".join(table(seen)))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
