"""A trained group's staleness split in two: versions published while it was generated
(in flight: from its oldest token to its entering the queue) and while it waited in the
queue (in queue: from entering to the version it is trained under). Their sum is the
staleness the queue bounds, whatever the order of puts, publishes and takes; the metrics
row reports each part's mean and max over the step's trained tokens."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.control.step_metrics import StepTotals, staleness_split, step_row
from buffers import ReplayQueue, ReplayQueueSnapshot, TakenGroups
from buffers.common.records import Group, Prompt, Sample, make_group
from buffers.plan.batching import shard_batches
from workers.trainer.config import TrainerConfig


class Item(msgspec.Struct, frozen=True, kw_only=True):
    """What the queue reads of a group."""

    prompt_id: str
    min_version: int
    num_tokens: int = 10


class Policy:
    """A trainer's version, as the queue reads it when a group enters."""

    def __init__(self) -> None:
        self.version = 0

    def current(self) -> int:
        return self.version


def new_queue(policy: Policy, max_staleness: int = 2) -> ReplayQueue[Item]:
    return ReplayQueue(max_groups=1000, max_tokens=10**6, max_staleness=max_staleness,
                       policy_version=policy.current)


def take(queue: ReplayQueue[Item], n: int, at_version: int) -> TakenGroups[Item]:
    async def taking() -> TakenGroups[Item]:
        return await queue.take_groups(n, at_version)
    return anyio.run(taking)


# put (how many versions older than the policy its oldest token is), publish, or take n.
operations = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 4)),
    st.tuples(st.just("publish"), st.just(0)),
    st.tuples(st.just("take"), st.integers(1, 3)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=operations, max_staleness=st.integers(0, 3))
def test_in_flight_plus_in_queue_is_the_staleness_the_queue_bounds(
        ops: list[tuple[str, int]], max_staleness: int) -> None:
    policy = Policy()
    queue = new_queue(policy, max_staleness)
    trained: list[tuple[int, int, int]] = []  # (staleness, in flight, in queue)
    for i, (op, arg) in enumerate(ops):
        if op == "put":
            queue.put_nowait(Item(prompt_id=f"p{i}", min_version=max(0, policy.version - arg)))
        elif op == "publish":
            policy.version += 1
        else:
            # A take at the policy's version drops what is too stale first; take only
            # when enough is left, so the take never has to wait.
            fresh = [g for g in queue.snapshot().items
                     if policy.version - g.min_version <= max_staleness]
            if len(fresh) < arg:
                continue
            taken = take(queue, arg, policy.version)
            assert len(taken.groups) == len(taken.entered_versions) == arg
            trained += [(taken.at_version - g.min_version, flying, queued)
                        for g, flying, queued in zip(taken.groups, taken.in_flight(),
                                                     taken.in_queue(), strict=True)]
    for staleness, flying, queued in trained:
        assert flying + queued == staleness <= max_staleness
        assert flying >= 0 and queued >= 0
    histogram = queue.statistics().staleness_taken
    assert sum(histogram) == len(trained)
    assert all(histogram[s] == sum(t[0] == s for t in trained) for s in range(len(histogram)))


def test_a_group_that_waited_several_versions_is_stale_in_queue() -> None:
    policy = Policy()
    queue = new_queue(policy, max_staleness=4)
    queue.put_nowait(Item(prompt_id="waited", min_version=0))  # entered at 0
    policy.version = 2
    queue.put_nowait(Item(prompt_id="generated", min_version=0))  # 2 versions in flight
    policy.version = 3
    taken = take(queue, 2, at_version=3)
    assert [g.prompt_id for g in taken.groups] == ["waited", "generated"]
    assert taken.entered_versions == (0, 2)
    assert taken.in_flight() == (0, 2)
    assert taken.in_queue() == (3, 1)


def test_without_a_policy_version_a_group_enters_at_the_last_take() -> None:
    queue: ReplayQueue[Item] = ReplayQueue(max_groups=8, max_tokens=10**6, max_staleness=3)
    queue.put_nowait(Item(prompt_id="first", min_version=0))  # before any take: 0
    take(queue, 1, at_version=0)
    queue.put_nowait(Item(prompt_id="old", min_version=0))
    queue.put_nowait(Item(prompt_id="new", min_version=2))  # never before its own tokens
    taken = take(queue, 2, at_version=2)
    assert taken.entered_versions == (0, 2)
    assert taken.in_flight() == (0, 0)
    assert taken.in_queue() == (2, 0)


def test_sorted_by_keeps_each_group_with_its_version() -> None:
    taken = TakenGroups(groups=(Item(prompt_id="b", min_version=0),
                                Item(prompt_id="a", min_version=1)),
                        at_version=3, entered_versions=(2, 1))
    ordered = taken.sorted_by(lambda g: g.prompt_id)
    assert [g.prompt_id for g in ordered.groups] == ["a", "b"]
    assert ordered.entered_versions == (1, 2)
    assert ordered.in_flight() == (0, 2) and ordered.in_queue() == (2, 1)


def test_snapshot_keeps_entered_versions_and_old_snapshots_still_restore() -> None:
    policy = Policy()
    queue = new_queue(policy, max_staleness=3)
    queue.put_nowait(Item(prompt_id="a", min_version=0))
    policy.version = 1
    queue.put_nowait(Item(prompt_id="b", min_version=0))
    snapshot = queue.snapshot()
    assert snapshot.entered_versions == (0, 1)
    encoded = msgspec.json.encode(snapshot)
    restored = new_queue(policy, max_staleness=3)
    restored.restore(msgspec.json.decode(encoded, type=ReplayQueueSnapshot[Item]))
    assert take(restored, 2, at_version=2).entered_versions == (0, 1)
    # A snapshot written before entered versions were kept: its groups enter now.
    old = msgspec.json.decode(encoded, type=dict[str, Any])
    del old["entered_versions"]
    policy.version = 2
    resumed = new_queue(policy, max_staleness=3)
    resumed.restore(msgspec.convert(old, type=ReplayQueueSnapshot[Item]))
    taken = take(resumed, 2, at_version=2)
    assert taken.entered_versions == (2, 2)
    assert taken.in_flight() == (2, 2) and taken.in_queue() == (0, 0)


# ---- the metrics row -----------------------------------------------------------------

PROMPT_IDS = (1, 2, 3)


def group(pid: str, version: int, completion: int = 4, samples: int = 2) -> Group:
    sample = Sample(token_ids=(5,) * completion, logprobs=(-0.5,) * completion,
                    versions=(version,) * completion, finish_reason="stop", text="x",
                    reward=1.0)
    return make_group(Prompt(prompt_id=pid, text="q", answer="a"), PROMPT_IDS,
                      [sample] * samples)


def row_of(taken: TakenGroups[Group]) -> dict[str, Any]:
    trainer = TrainerConfig()
    _, plan = shard_batches(list(taken.groups), 1, trainer, step=1)
    queue: ReplayQueue[Group] = ReplayQueue(max_groups=4, max_tokens=10**6,
                                            max_staleness=8)
    return step_row(step=1, version=taken.at_version + 1, taken=taken, results=[],
                    plan=plan, wait_s=1.0, train_s=0.5, sync_s=0.5, timings=[],
                    queue=queue.statistics(), totals=StepTotals(), trainer=trainer)


SPLIT = ("staleness_in_flight_mean", "staleness_in_flight_max",
         "staleness_in_queue_mean", "staleness_in_queue_max")


def test_an_empty_step_reports_zero() -> None:
    empty: TakenGroups[Group] = TakenGroups(groups=(), at_version=5, entered_versions=())
    assert staleness_split(empty, []) == dict.fromkeys(SPLIT, 0)


def test_one_group_reports_its_own_split() -> None:
    row = row_of(TakenGroups(groups=(group("p", version=1),), at_version=4,
                             entered_versions=(3,)))
    assert row["staleness_max"] == 3 and row["staleness_histogram"] == [0, 0, 0, 1]
    assert [row[k] for k in SPLIT] == [2.0, 2, 1.0, 1]


def test_zero_staleness_everywhere() -> None:
    groups = (group("a", version=2), group("b", version=2))
    row = row_of(TakenGroups(groups=groups, at_version=2, entered_versions=(2, 2)))
    assert row["staleness_histogram"] == [2]
    assert [row[k] for k in SPLIT] == [0.0, 0, 0.0, 0]


def test_means_weigh_each_group_by_its_trained_tokens() -> None:
    # a: 2 x (3 + 4) = 14 tokens, 3 versions in flight; b: 2 x (3 + 11) = 28 tokens,
    # entered as soon as generated, waited 2 versions.
    groups = (group("a", version=0), group("b", version=1, completion=11))
    row = row_of(TakenGroups(groups=groups, at_version=3, entered_versions=(3, 1)))
    assert row["tokens_trained"] == 42
    assert row["staleness_in_flight_mean"] == pytest.approx(3 * 14 / 42)
    assert row["staleness_in_queue_mean"] == pytest.approx(2 * 28 / 42)
    assert (row["staleness_in_flight_max"], row["staleness_in_queue_max"]) == (3, 2)
    assert row["staleness_max"] == 3


def test_a_group_without_trained_tokens_weighs_nothing() -> None:
    taken = TakenGroups(groups=(group("a", version=0), group("b", version=2)),
                        at_version=4, entered_versions=(1, 4))
    split = staleness_split(taken, [0, 10])
    assert split == {"staleness_in_flight_mean": 2.0, "staleness_in_flight_max": 2,
                     "staleness_in_queue_mean": 0.0, "staleness_in_queue_max": 0}
