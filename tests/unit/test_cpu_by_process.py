"""scripts/cpu_by_process.py: process kinds from command lines, and a real command's CPU
counted."""

from __future__ import annotations

import subprocess
import sys

from script_modules import ROOT, load_script

cpu_by_process = load_script("scripts/cpu_by_process.py", "cpu_by_process")


def test_kinds_from_command_lines() -> None:
    kind = cpu_by_process.kind
    assert kind("VLLM::EngineCore") == "vLLM engine core"
    assert kind("python -c from multiprocessing.spawn import spawn_main; "
                "spawn_main(tracker_fd=5)") == "vLLM engine core"
    assert kind("ray::RolloutActor.generate_group_ref") == "ray actor RolloutActor"
    assert kind("ray::TrainerActor") == "ray actor TrainerActor"
    assert kind("ray::IDLE") == "ray worker waiting for work"
    assert kind("/venv/bin/python /venv/ray/_private/workers/default_worker.py "
                "--node-ip-address=127.0.0.1") == "ray worker starting"
    assert kind("/venv/lib/ray/core/src/ray/gcs/gcs_server --log_dir=x") == "ray's own processes"
    assert kind("/venv/bin/python -u /venv/ray/_private/log_monitor.py") == "ray's own processes"
    assert kind("/venv/bin/python -m pytest tests -n 2") == "pytest"
    assert kind("/usr/bin/git status") == "git"
    assert kind("") == "?"


def test_an_empty_sample_is_a_zero_total() -> None:
    assert cpu_by_process.table({}) == ["      0.0 CPU-s  total"]


def test_a_busy_child_is_counted_and_its_status_kept() -> None:
    busy = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cpu_by_process.py"), "--interval", "0.1",
         "--", sys.executable, "-c", busy + "\nraise SystemExit(3)"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) >= 2 and lines[-1].endswith("total")
    total = float(lines[-1].split()[0])
    assert total >= 0.4, done.stdout
