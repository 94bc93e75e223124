"""A run across two Ray nodes on this machine: rollout on one, training on the other.

``ray.cluster_utils.Cluster`` starts a head node and a second node, each a separate
raylet with one CPU, so the rollout placement group and the trainer placement group
cannot share a node. The run joins the cluster through ``run.ray_address``, as a user
would point it at a real one, and must complete, keep its contracts and learn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from async_rl.config import decode_config
from async_rl.ray_shell import run_training
from async_rl.run_dir import WORKERS, read_metrics
from async_rl.tiny_model import make_model

pytestmark = pytest.mark.ray


LEARNABLE_SFT_STEPS = 400
"""Warm start long enough that greedy accuracy starts near 0.17, where ten RL steps show
(the shared tiny fixture starts near 0, where they cannot)."""


@pytest.fixture(scope="module")
def learnable_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("learnable-model")
    make_model(out, seed=0, sft_steps=LEARNABLE_SFT_STEPS, eval_size=64, log=None)
    return out


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
        "rollout": {"group_size": 8, "max_new_tokens": 6, "max_inflight_prompts": 8},
        "trainer": {"groups_per_step": 8, "micro_batch_tokens": 1024, "lr": 3e-4},
        "run": {"num_steps": 10, "output_dir": str(tmp_path), "progress": False,
                "ray_address": two_nodes.address},
    })
    summary = run_training(config)
    assert not ray.is_initialized()  # it joined the cluster and left it; the nodes remain
    assert summary.steps == 10 and summary.groups_trained == 80

    workers = json.loads((tmp_path / WORKERS).read_text())
    assert sorted(w["role"] for w in workers) == ["rollout", "trainer"]
    nodes = {w["role"]: w["node_id"] for w in workers}
    assert nodes["rollout"] and nodes["trainer"] and nodes["rollout"] != nodes["trainer"]

    # It learns: held-out greedy accuracy and the training reward both go up.
    assert summary.accuracy_start is not None and summary.accuracy_end is not None
    assert summary.accuracy_end > summary.accuracy_start
    rows = read_metrics(tmp_path)
    assert len(rows) == 10
    first = sum(r["reward_mean"] for r in rows[:3]) / 3
    last = sum(r["reward_mean"] for r in rows[-3:]) / 3
    assert last > first
