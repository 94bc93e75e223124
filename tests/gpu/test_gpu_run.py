"""The same async GRPO run on CUDA: NCCL trainer shards, the CUDA vLLM engine, NVML, and
weights over gloo (the default) or vLLM's NCCL weight-transfer engine."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.ray]


@pytest.mark.parametrize("transport", ["gloo", "nccl"])
def test_async_grpo_runs_on_gpu_with_nvml_cross_check(tmp_path: Path, transport: str) -> None:
    import ray

    from async_rl.analysis.report import build_report
    from async_rl.config_io import decode_config
    from async_rl.models.tiny_model import make_model
    from async_rl.shell.ray_shell import run_training

    model = tmp_path / "model"
    make_model(model, seed=0, sft_steps=50, eval_size=16, log=None)
    config = decode_config({
        "model": {"path": str(model)},
        "task": {"eval_size": 16},
        "rollout": {"group_size": 4, "max_new_tokens": 6, "memory_fraction": 0.3},
        "staleness": {"max_staleness": 1},
        "trainer": {"groups_per_step": 4},
        "weights": {"transport": transport},
        "run": {"num_steps": 4, "output_dir": str(tmp_path / "run"), "progress": False},
    })
    try:
        summary = run_training(config)
    finally:
        ray.shutdown()
    assert summary.steps == 4
    assert summary.rollout_version == summary.final_version == 4
    assert len(summary.staleness_histogram) <= 2
    idle = build_report(tmp_path / "run")
    assert any("gpu_util" in check for check in idle.cross_check.values())
