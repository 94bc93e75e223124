"""A run across two Ray nodes on this machine: rollout on one, training on the other.

``ray.cluster_utils.Cluster`` starts a head node and a second node, each a separate
raylet with one CPU, so the rollout placement group and the trainer placement group
cannot share a node. The run joins the cluster through ``run.ray_address``, as a user
would point it at a real one, and must complete, keep its contracts and learn. Its model,
``learnable_model_dir`` (tests/conftest.py), is the CPU default's small model, built once
per checkout.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from async_rl.config_io import decode_config
from async_rl.run.run_dir import WORKERS, read_metrics
from async_rl.shell.ray_shell import run_training

pytestmark = pytest.mark.ray


STEPS = 20


@pytest.fixture
def two_nodes() -> Iterator[Cluster]:
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_rollout_and_training_on_two_nodes_learn(
    two_nodes: Cluster, learnable_model_dir: Path, tmp_path: Path
) -> None:
    config = decode_config({
        "model": {"path": str(learnable_model_dir)},
        "task": {"eval_size": 64},
        "rollout": {"group_size": 8, "max_new_tokens": 6, "max_inflight_prompts": 16},
        "trainer": {"groups_per_step": 16, "micro_batch_tokens": 2048, "lr": 3e-5},
        "run": {"num_steps": STEPS, "output_dir": str(tmp_path), "progress": False,
                "ray_address": two_nodes.address},
    })
    summary = run_training(config)
    assert not ray.is_initialized()  # it joined the cluster and left it; the nodes remain
    assert summary.steps == STEPS and summary.groups_trained == STEPS * 16
    # Every version crossed from the trainer's node to the rollout engine's.
    assert summary.rollout_version == summary.final_version == STEPS

    workers = json.loads((tmp_path / WORKERS).read_text())
    assert sorted(w["role"] for w in workers) == ["rollout", "trainer"]
    nodes = {w["role"]: w["node_id"] for w in workers}
    assert nodes["rollout"] and nodes["trainer"] and nodes["rollout"] != nodes["trainer"]

    # It learns: held-out greedy accuracy and the training reward both go up (on one
    # node the same run went from 0.20 to 0.94).
    assert summary.accuracy_start is not None and summary.accuracy_end is not None
    assert summary.accuracy_end > summary.accuracy_start + 0.2
    rows = read_metrics(tmp_path)
    assert len(rows) == STEPS
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert last > first
