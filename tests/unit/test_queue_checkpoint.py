"""The replay queue in a checkpoint, through the real orchestrator on in-process fakes (no
Ray): a stop keeps the queue's groups with their tokens; a resume trains the admissible
ones without generating them again and drops the stale ones as stale drops; a
checkpoint of the older layout (no queue file) resumes; and over random runs, stops and
lost tokens, a prompt is in exactly one place at a checkpoint: owed, queued or trained."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from orchestrator_fakes import (
    LOST,
    FakeRollout,
    FakeTrainer,
    InProcessTokens,
    config,
    ledger,
    restored_and_trained,
    run,
    trained_once_or_unfinished,
)
from test_checkpoint import to_older_layout

from async_rl.config import Config
from async_rl.control.checkpoint_files import latest_checkpoint
from async_rl.run.run_dir import LEDGER
from buffers.common.records import Group, GroupTokens, Prompt


def with_staleness(cfg: Config, max_staleness: int) -> Config:
    return msgspec.structs.replace(cfg, staleness=msgspec.structs.replace(
        cfg.staleness, max_staleness=max_staleness))


def test_restored_groups_too_stale_for_the_resumed_run_are_dropped_as_stale(
    tmp_path: Path,
) -> None:
    """Stopped at η = 2 with groups of versions 1-3 queued, resumed at η = 0 (version
    3): the older ones are dropped and counted as stale drops, and run again; the others
    are trained as they were generated."""
    cfg = config(tmp_path, steps=6, max_staleness=2)
    run(cfg, {0: FakeRollout(0)}, [FakeTrainer(0)], stop_after=3)
    _, saved = latest_checkpoint(tmp_path)
    stale = {s.group.prompt_id for s in saved.queue if s.group.min_version < saved.version}
    fresh = {s.group.prompt_id for s in saved.queue} - stale
    assert stale, [s.group.min_version for s in saved.queue]

    tokens = InProcessTokens()
    second = run(with_staleness(cfg, 0), {0: FakeRollout(0)}, [FakeTrainer(0)],
                 resume=True, tokens=tokens)
    assert tokens.put_back == len(saved.queue)
    assert second.dropped_stale >= saved.counters.dropped_stale + len(stale)
    events = ledger(tmp_path)
    trained_once_or_unfinished(events)
    assert restored_and_trained(events) == stale | fresh
    for prompt in stale:  # dropped at the restore, run again as its next attempt
        kinds = [(e["event"], e["reason"]) for e in events[prompt]]
        at = kinds.index(("restored", "resume"))
        assert kinds[at + 1: at + 3] == [("dropped", "stale"), ("requeued", "stale")]
        assert ("generated", "") in kinds[at:]
    # η = 0 from the resume on: every group it trained was on-policy.
    assert all(n == saved.counters.staleness.get(s, 0)
               for s, n in enumerate(second.staleness_histogram) if s > 0)


class NoTokens(InProcessTokens):
    """A store that has none of the groups' tokens: what a checkpoint made before the
    queue was kept holds (every queued group's prompt owed, no queue)."""

    async def fetch(self, refs: Sequence[object]) -> list[GroupTokens | None]:
        return [None] * len(refs)


def test_a_checkpoint_of_the_older_layout_resumes_with_nothing_lost(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=6, max_staleness=2)
    run(cfg, {0: FakeRollout(0)}, [FakeTrainer(0)], stop_after=3, tokens=NoTokens())
    folder, saved = latest_checkpoint(tmp_path)
    assert saved.queue == () and saved.gate.started == saved.counters.groups_trained
    to_older_layout(folder)

    second = run(cfg, {0: FakeRollout(0)}, [FakeTrainer(0)], resume=True)
    assert second.steps == second.final_version == 6
    events = ledger(tmp_path)
    counts = trained_once_or_unfinished(events)
    assert counts["trained"] == 6 * cfg.trainer.groups_per_step
    assert not restored_and_trained(events)
    assert {p.prompt_id for p in saved.reissue} <= {
        p for p, h in events.items() if any(e["reason"] == "resume" for e in h)}


class LosingRollout(FakeRollout):
    """Loses the tokens of its generations numbered in ``lose`` (its process died after
    generating them): a checkpoint cannot keep those groups."""

    def __init__(self, rank: int, lose: frozenset[int], delay: float) -> None:
        super().__init__(rank, delay=delay)
        self.lose = lose

    async def generate(self, prompt: Prompt) -> Group:
        group = await super().generate(prompt)
        lost = self.generated in self.lose
        return msgspec.structs.replace(group, tokens=LOST) if lost else group


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(max_staleness=st.integers(0, 3), stop_after=st.integers(1, 3),
       delays=st.lists(st.sampled_from((0.001, 0.004, 0.02)), min_size=1, max_size=2),
       lose=st.frozensets(st.integers(1, 24), max_size=3))
def test_at_a_checkpoint_every_prompt_is_owed_queued_or_trained_and_only_one(
    tmp_path_factory: object, max_staleness: int, stop_after: int, delays: list[float],
    lose: frozenset[int],
) -> None:
    out = tmp_path_factory.mktemp("run")  # type: ignore[attr-defined]
    cfg = config(out, steps=stop_after + 2, max_staleness=max_staleness)
    rollout = {rank: LosingRollout(rank, lose, delay) for rank, delay in enumerate(delays)}
    run(cfg, rollout, [FakeTrainer(0)], stop_after=stop_after, virtual=True)
    _, saved = latest_checkpoint(out)

    lines = (out / LEDGER).read_text().splitlines()[: saved.files.ledger]
    before = [json.loads(line) for line in lines]
    assert before
    admitted = {e["prompt_id"] for e in before if e["event"] == "admitted"}
    trained = {e["prompt_id"] for e in before if e["event"] == "trained"}
    ended = {e["prompt_id"] for e in before if e["event"] == "dropped"
             and e["reason"] in ("filtered", "readmissions_exhausted")}
    queued = [s.group.prompt_id for s in saved.queue]
    owed = [p.prompt_id for p in saved.reissue]
    assert len(set(queued)) == len(queued) and len(set(owed)) == len(owed)
    assert not set(queued) & set(owed)
    assert not (set(queued) | set(owed)) & (trained | ended)
    assert set(queued) | set(owed) == admitted - trained - ended
    assert all(s.tokens is not None for s in saved.queue)  # lost ones are owed instead
    assert saved.gate.started == saved.counters.groups_trained + len(saved.queue)

    run(cfg, {r: FakeRollout(r) for r in rollout}, [FakeTrainer(0)], resume=True,
        virtual=True)
    events = ledger(out)
    trained_once_or_unfinished(events)
    assert restored_and_trained(events) == set(queued)
