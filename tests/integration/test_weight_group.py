"""The trainer's end of a weight broadcast (``WeightSender``, ``GroupClient``, the gloo
trainer engine) against members that receive over the real gloo group in their own Ray
actors, without vLLM: a stuck member and a dead one each fail the broadcast within the
deadline, the others take the version again over a group without it, and a member
that rejoins takes the next version."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from buffers.common.reports import BroadcastTiming
from workers.weights.bucket_transfer import broadcast_group, join_store, receive_buckets
from workers.weights.config import WeightsConfig
from workers.weights.receiver import INTERRUPTED, UpdateInterrupted
from workers.weights.sender import WeightSender

pytestmark = pytest.mark.ray
# The member class runs in actors, which cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIMEOUT_S = 3.0
STATE = [("a", torch.arange(3000, dtype=torch.float32)), ("b", torch.ones(7, 5))]


class Member:
    """A rollout worker's weight protocol over the real gloo data plane; what it holds
    stands for its engine's weights (staged, then applied whole at finish)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.version, self.pending = rank, 0, 0
        self.group: Any = None
        self.staged: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        self.bucket_bytes, self.timeout_s = 0, 0.0

    def pid(self) -> int:
        return os.getpid()

    def init_weight_transfer(self, info: dict[str, Any]) -> None:
        try:
            store = join_store(info["master_address"], info["master_port"], info["timeout_s"])
            self.group = broadcast_group(store, info["rank_offset"], info["world_size"],
                                         info["timeout_s"])
        except Exception as err:
            raise UpdateInterrupted(f"{INTERRUPTED}: {err!r}") from err
        self.bucket_bytes, self.timeout_s = info["bucket_bytes"], info["timeout_s"]

    def start_weight_update(self, version: int, mode: Any = None) -> None:
        self.pending = version

    def update_weights(self, info: dict[str, Any]) -> None:
        specs = [(shape, getattr(torch, dtype))
                 for shape, dtype in zip(info["shapes"], info["dtype_names"], strict=True)]
        try:
            self.staged = [t for ready in receive_buckets(self.group, specs, self.bucket_bytes,
                                                          self.timeout_s)
                           for _, t in ready]
        except RuntimeError as err:
            self.pending = 0
            raise UpdateInterrupted(f"member {self.rank}: {err!r}") from err

    def cancel_weight_update(self) -> None:
        self.pending = 0

    def finish_weight_update(self) -> BroadcastTiming:
        self.weights, self.version = self.staged, self.pending
        return BroadcastTiming(version=self.version, rollout_rank=self.rank, publish_s=0.0,
                               transfer_s=0.0, pause_s=0.0, load_s=0.0)

    def abandon_weight_update(self, reason: str) -> None:
        self.pending = 0

    def held(self) -> tuple[int, list[torch.Tensor]]:
        return self.version, self.weights


@pytest.fixture
def members(ray_cluster: None) -> Iterator[list[Any]]:
    """Three members, started (each answers) before the test broadcasts, as a run starts
    its rollout workers first: an actor still starting when a group forms (its process
    importing torch, slow on busy cores) would miss the group's TIMEOUT_S."""
    made = [ray.remote(Member).options(num_cpus=0, max_concurrency=4).remote(rank)
            for rank in range(3)]
    assert len(ray.get([member.pid.remote() for member in made], timeout=120)) == 3
    yield made
    for member in made:
        ray.kill(member)


def sender_of(members: list[Any]) -> WeightSender:
    sender = WeightSender(WeightsConfig(transport="gloo", bucket_mb=1, timeout_s=TIMEOUT_S),
                          address="127.0.0.1", device=torch.device("cpu"))
    for rank, member in enumerate(members):
        sender.connect(rank, member)
    return sender


def deliver(sender: WeightSender, version: int, ranks: list[int]) -> Any:
    sender.snapshot(version, [(n, t + version) for n, t in STATE])
    try:
        return sender.send(version, ranks)
    finally:
        sender.release(version)


def holds(member: Any, version: int) -> bool:
    held, tensors = ray.get(member.held.remote(), timeout=30)
    return held == version and len(tensors) == len(STATE) and all(
        torch.equal(t, s + version) for t, (_, s) in zip(tensors, STATE, strict=True))


def test_every_member_takes_the_version_in_one_broadcast(members: list[Any]) -> None:
    sender = sender_of(members)
    delivery = deliver(sender, 1, [0, 1, 2])
    assert (delivery.failed, delivery.attempts) == ([], 1)
    assert [t.rollout_rank for t in delivery.timings] == [0, 1, 2]
    assert 0 < delivery.wire_s < TIMEOUT_S
    assert all(holds(m, 1) for m in members)
    # The group is kept for the next version.
    again = deliver(sender, 2, [0, 1, 2])
    assert again.attempts == 1 and all(holds(m, 2) for m in members)


@pytest.mark.parametrize("how", ["stuck", "dead"])
def test_a_lost_member_is_left_out_and_the_others_take_the_version_again(
        members: list[Any], how: str) -> None:
    sender = sender_of(members)
    assert not deliver(sender, 1, [0, 1, 2]).failed
    pid = ray.get(members[1].pid.remote(), timeout=30)  # the middle of the chain
    os.kill(pid, signal.SIGSTOP if how == "stuck" else signal.SIGKILL)
    began = time.monotonic()
    try:
        delivery = deliver(sender, 2, [0, 1, 2])
    finally:
        if how == "stuck":
            os.kill(pid, signal.SIGCONT)
    took = time.monotonic() - began
    assert delivery.failed == [1]
    assert [t.rollout_rank for t in delivery.timings] == [0, 2]
    assert delivery.attempts == 2
    assert holds(members[0], 2) and holds(members[2], 2)
    # Its neighbours failed by their own deadline; the sender waited for their answers
    # (a dead member's at once), then broadcast again.
    assert took < 3 * TIMEOUT_S + 2 * 5.0 + 10
    # A replacement joins at the next version.
    replacement = ray.remote(Member).options(num_cpus=0, max_concurrency=4).remote(1)
    ray.get(replacement.pid.remote(), timeout=60)  # started, as a run starts it first
    sender.connect(1, replacement)
    nxt = deliver(sender, 3, [0, 1, 2])
    assert (nxt.failed, nxt.attempts) == ([], 1)
    assert holds(members[0], 3) and holds(replacement, 3) and holds(members[2], 3)
    ray.kill(replacement)


def test_a_member_already_on_a_newer_version_is_skipped_not_lost(members: list[Any]) -> None:
    sender = sender_of(members)

    class Newer(Member):
        def start_weight_update(self, version: int, mode: Any = None) -> None:
            from workers.weights.receiver import StaleVersion

            raise StaleVersion(f"member {self.rank} runs a newer version")

    newer = ray.remote(Newer).options(num_cpus=0, max_concurrency=4).remote(1)
    ray.get(newer.pid.remote(), timeout=60)
    sender.connect(1, newer)
    delivery = deliver(sender, 1, [0, 1, 2])
    assert delivery.failed == [] and delivery.attempts == 2
    assert [t.rollout_rank for t in delivery.timings] == [0, 2]
    assert holds(members[0], 1) and holds(members[2], 1)
    ray.kill(newer)


def test_no_members_and_unconnected_ranks() -> None:
    sender = WeightSender(WeightsConfig(), address="127.0.0.1", device=torch.device("cpu"))
    sender.snapshot(1, STATE)
    empty = sender.send(1, [])
    assert (empty.timings, empty.failed, empty.attempts) == ([], [], 0)
    unknown = sender.send(1, [5])
    assert unknown.failed == [5] and unknown.attempts == 0
