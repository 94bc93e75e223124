"""Failures a run must survive or refuse cleanly: a rollout worker dies mid-run (the run
is told, goes on with the others, loses nothing), and a weight transport the hardware
does not have (one config line, exit status 2)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import ray

from async_rl.cli import main
from async_rl.config import decode_config
from async_rl.ray_shell import NAMESPACE, run_training
from async_rl.run_dir import METRICS, RunSummary, read_ledger

pytestmark = pytest.mark.ray


def test_dead_rollout_worker_is_retired_and_its_prompts_requeued(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None
) -> None:
    out = tmp_path / "run"
    config = decode_config({
        "model": {"path": str(tiny_model_dir)},
        "task": {"eval_size": 0},
        "rollout": {"num_workers": 2, "group_size": 4, "max_new_tokens": 6,
                    "max_inflight_prompts": 4, "memory_fraction": 0.1},
        "staleness": {"max_staleness": 1},
        "trainer": {"groups_per_step": 4, "micro_batch_tokens": 512},
        "run": {"num_steps": 12, "output_dir": str(out), "progress": False},
    })
    result: list[RunSummary] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(run_training(config))
        except BaseException as err:  # surfaced by the assertions below
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not errors:
        metrics = out / METRICS
        if metrics.exists() and len(metrics.read_bytes().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert not errors, errors
    ray.kill(ray.get_actor("rollout-1", namespace=NAMESPACE))
    thread.join(timeout=240)
    assert not thread.is_alive()
    assert not errors, errors
    (summary,) = result
    assert summary.steps == 12
    assert summary.retired_workers == 1
    # The dead worker's transfer group failed alone: the survivor got every version.
    assert summary.rollout_version == summary.final_version == 12
    entries = read_ledger(out)
    trained = [e.prompt_id for e in entries if e.event == "trained"]
    assert len(trained) == len(set(trained)) == 12 * 4
    requeued = {e.prompt_id for e in entries if e.event == "requeued"}
    assert all(e.reason for e in entries if e.event in ("failed", "requeued"))
    # Every prompt the dead worker held came back and was admitted again.
    for pid in requeued:
        admitted = [e for e in entries if e.prompt_id == pid and e.event == "admitted"]
        assert len(admitted) >= 2, pid


def test_cuda_transport_without_gpus_is_a_config_error(
    tiny_model_dir: Path, tmp_path: Path, ray_shutdown: None,
    capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[model]\npath = "{tiny_model_dir}"\n[run]\nprogress = false\n'
                      f'output_dir = "{tmp_path / "run"}"\n')
    assert main(["train", str(config), "--set", "weights.transport=nccl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("config error: weights.transport = 'nccl': needs CUDA GPUs, and the "
                       'workers have none; use "gloo" on CPU')
