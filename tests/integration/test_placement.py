"""A placement the cluster cannot hold fails within run.call_timeout_s, in one line that
names what was asked and what the node has (exit status 2), instead of waiting forever.

On CPU: the run asks a two-CPU Ray for three CPUs (a two-core rollout worker and a
one-core trainer shard); on a one-GPU node the default split layout asking for two GPU
bundles is the same wait (``workers.placement.check_gpus`` refuses that one before Ray
is asked: tests/unit/test_gpu_paths.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from async_rl.cli import main

pytestmark = pytest.mark.ray


def test_an_unplaceable_layout_fails_in_one_line_within_the_call_timeout(
    tiny_model_dir: Path, tmp_path: Path, ray_cluster: None,
    capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[model]\npath = "{tiny_model_dir}"\n[run]\nprogress = false\n'
                      f'call_timeout_s = 3.0\noutput_dir = "{tmp_path / "run"}"\n'
                      "[rollout]\ncpus_per_worker = 2\n")
    began = time.monotonic()
    assert main(["train", str(config)]) == 2
    took = time.monotonic() - began
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("placement error: no placement within 3s (run.call_timeout_s) for "
                       "rollout: 1 x {CPU 2, GPU 0}; trainer: 1 x {CPU 1, GPU 0}; the "
                       "cluster has CPU 2, GPU 0 in all")
    # The deadline, plus the start before placement (imports, the task: seconds, more on
    # a busy machine); without one it would wait forever.
    assert took < 60, took
