"""scripts/gpu-check.sh on a machine without CUDA: one line, exit 0, and the trainer's
import chain (what the GPU machine runs without ray or vllm) checked on the way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA run is the check itself")
def test_without_cuda_the_check_skips_in_one_line() -> None:
    done = subprocess.run([str(REPO / "scripts" / "gpu-check.sh")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"gpu check skipped: no CUDA device (torch {torch.__version__}; imports checked, "
        "no ray or vllm)"]


def test_the_carried_wheels_fit_the_gpu_machine() -> None:
    wheels = sorted(p.name for p in (REPO / "scripts" / "wheels").iterdir())
    assert len(wheels) == 2
    assert wheels[0].startswith("msgspec-") and "-cp312-" in wheels[0]
    assert wheels[1].startswith("nvidia_ml_py-") and wheels[1].endswith("py3-none-any.whl")
    assert sum((REPO / "scripts" / "wheels" / w).stat().st_size for w in wheels) < 1 << 20
