"""Partial rollouts through the real orchestrator on in-process fakes (no Ray): a clean
stop has the engines hand their rollouts in progress back, the checkpoint keeps them, and
a resume continues each from its kept tokens (bit-identical prefix, trained once); one
too stale at the resume is dropped as a stale drop; an engine that stops itself hands
its rollouts to another engine; a multi-turn group (nothing kept) restarts; a checkpoint
of the older layout (no partials) still resumes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec
from orchestrator_fakes import (
    FakeRollout,
    FakeTrainer,
    config,
    ledger,
    run,
    trained_once_or_unfinished,
)
from test_checkpoint import to_older_layout

from async_rl.control.checkpoint_files import MANIFEST, PARTIALS, latest_checkpoint
from async_rl.control.orchestrator import Orchestrator
from buffers.common.partials import PartialGroup, PartialSample, encode_partials
from buffers.common.records import Group, Prompt, Sample, make_group

PROMPT_IDS = (1, 2)


def kept_sample(k: int, version: int) -> PartialSample:
    """Sample ``k`` as a fake engine hands it back: k tokens so far (none for sample
    0), each with its own log-prob; sample 3 had finished (EOS)."""
    return PartialSample(token_ids=tuple(range(10, 10 + k)),
                         logprobs=tuple(-0.1 * (i + 1) - 0.01 * k for i in range(k)),
                         versions=(version,) * k, finish_reason="stop" if k == 3 else "")


class HandingBack(FakeRollout):
    """A fake engine that can hand its rollouts back (``HandsBack``): a group takes
    ``delay`` times 1 to 3 (by its prompt: they end staggered); handed back before, it
    comes back as a partial group of 4 samples (``kept_sample``); ``multi_turn``: with
    nothing kept (the trajectory restarts)."""

    def __init__(self, rank: int, *, delay: float = 0.05, multi_turn: bool = False) -> None:
        super().__init__(rank, delay=delay)
        self.multi_turn = multi_turn
        self.handed = anyio.Event()
        self.leaving = False
        self.continued: list[PartialGroup] = []
        self.running = 0

    async def generate(self, prompt: Prompt) -> Group | PartialGroup:  # type: ignore[override]
        started = self.version_now
        self.running += 1
        try:
            with anyio.move_on_after(self.delay * (1 + int(prompt.prompt_id[-1]) % 3)):
                await self.handed.wait()
        finally:
            self.running -= 1
        if self.handed.is_set():
            samples = () if self.multi_turn else tuple(kept_sample(k, started)
                                                       for k in range(4))
            return PartialGroup(prompt=prompt, prompt_token_ids=PROMPT_IDS if samples else (),
                                samples=samples, rollout_rank=self.rank,
                                restarts="multi_turn" if self.multi_turn else "",
                                leaving=self.leaving)
        self.generated += 1
        return make_group(prompt, PROMPT_IDS, [
            Sample(token_ids=(5,) * (1 + k), logprobs=(-0.5,) * (1 + k),
                   versions=(started,) * (1 + k), finish_reason="stop", text="x",
                   reward=float(k % 2)) for k in range(4)], rollout_rank=self.rank)

    async def continue_group(self, partial: PartialGroup) -> Group | PartialGroup:
        assert not self.handed.is_set()
        self.continued.append(partial)
        samples = []
        for k, kept in enumerate(partial.samples):
            more = () if kept.finished else (7,)
            samples.append(Sample(
                token_ids=kept.token_ids + more, logprobs=kept.logprobs + (-0.25,) * len(more),
                versions=kept.versions + (self.version_now,) * len(more),
                finish_reason=kept.finish_reason or "stop", text="x", reward=float(k % 2)))
        return make_group(partial.prompt, partial.prompt_token_ids, samples,
                          rollout_rank=self.rank)

    async def hand_back(self) -> int:
        self.handed.set()
        return self.running

    async def leave(self) -> int:
        self.leaving = True
        return await self.hand_back()


def stop_with_partials(tmp_path: Path, *, multi_turn: bool = False
                       ) -> tuple[Sequence[PartialGroup], int]:
    """A run at η = 2 stopped after step 3 with groups in flight (each takes 50 ms on
    the virtual clock, training none): the checkpoint's partial groups and version."""
    cfg = config(tmp_path, steps=6, max_staleness=2)
    first = run(cfg, {0: HandingBack(0, multi_turn=multi_turn)}, [FakeTrainer(0)],
                stop_after=3, virtual=True)
    assert first.stopped == "SIGINT" and first.steps == 3
    _, saved = latest_checkpoint(tmp_path)
    # A prompt is in one place only: partial, queued, owed or trained.
    partial = [p.prompt.prompt_id for p in saved.partials]
    assert len(set(partial)) == len(partial)
    assert not set(partial) & {p.prompt_id for p in saved.reissue}
    assert not set(partial) & {s.group.prompt_id for s in saved.queue}
    assert saved.gate.started == saved.counters.groups_trained + len(saved.queue)
    return saved.partials, saved.version


def test_a_stop_keeps_the_rollouts_in_flight_and_the_resume_continues_them(
    tmp_path: Path,
) -> None:
    partials, version = stop_with_partials(tmp_path)
    assert len(partials) == 4  # the worker's four prompts in flight at the stop
    for partial in partials:  # a mixed group: 0 tokens, cut short, finished (EOS)
        assert partial.kept_lengths == (0, 1, 2, 3)
        assert partial.samples[3].finished and not partial.samples[1].finished

    engine = HandingBack(0)
    cfg = config(tmp_path, steps=6, max_staleness=2)
    second = run(cfg, {0: engine}, [FakeTrainer(0)], resume=True, virtual=True)
    assert second.steps == second.final_version == 6
    # Each partial continued once, from what the checkpoint kept, exactly.
    assert len(engine.continued) == len(partials)
    assert {p.prompt.prompt_id: p for p in engine.continued} == {
        p.prompt.prompt_id: p for p in partials}
    events = ledger(tmp_path)
    counts = trained_once_or_unfinished(events)
    assert counts["trained"] == 6 * cfg.trainer.groups_per_step
    for partial in partials:
        kinds = [(e["event"], e["reason"]) for e in events[partial.prompt.prompt_id]]
        at = kinds.index(("handed_back", "stop"))
        assert kinds[at:] == [("handed_back", "stop"), ("unfinished", "run_ended"),
                              ("partial_restored", "resume"), ("admitted", "continue"),
                              ("generated", ""), ("trained", "")], kinds
        lengths = [e["lengths"] for e in events[partial.prompt.prompt_id]
                   if e["event"] in ("handed_back", "partial_restored", "admitted")]
        assert lengths[-3:] == [[0, 1, 2, 3]] * 3
    assert all(p.min_version <= version for p in partials)


def test_a_partial_too_stale_at_the_resume_is_dropped_as_stale_and_runs_again(
    tmp_path: Path,
) -> None:
    """The checkpoint's partials rewritten with tokens 3 versions older than the stop:
    at η = 2 none may continue; each is dropped and counted as a stale drop, and its
    prompt runs again from the start (next attempt)."""
    partials, version = stop_with_partials(tmp_path)
    folder, saved = latest_checkpoint(tmp_path)
    old = tuple(msgspec.structs.replace(p, samples=tuple(
        msgspec.structs.replace(s, versions=(version - 3,) * len(s.token_ids))
        for s in p.samples)) for p in partials)
    rewrite_partials(folder, old)

    engine = HandingBack(0)
    cfg = config(tmp_path, steps=6, max_staleness=2)
    second = run(cfg, {0: engine}, [FakeTrainer(0)], resume=True, virtual=True)
    assert engine.continued == []
    assert second.dropped_stale >= saved.counters.dropped_stale + len(partials)
    events = ledger(tmp_path)
    trained_once_or_unfinished(events)
    for partial in partials:
        history = events[partial.prompt.prompt_id]
        kinds = [(e["event"], e["reason"]) for e in history]
        at = kinds.index(("partial_restored", "resume"))
        assert kinds[at + 1: at + 3] == [("dropped", "stale"), ("requeued", "stale")]
        assert kinds[-1] == ("trained", "") and history[-1]["attempt"] == 1


def rewrite_partials(folder: Path, partials: Sequence[PartialGroup]) -> None:
    import hashlib
    import json

    (folder / PARTIALS).write_bytes(encode_partials(partials))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest[PARTIALS] = hashlib.sha256((folder / PARTIALS).read_bytes()).hexdigest()
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_a_multi_turn_group_handed_back_keeps_nothing_and_restarts(tmp_path: Path) -> None:
    partials, _ = stop_with_partials(tmp_path, multi_turn=True)
    assert partials == ()
    events = ledger(tmp_path)
    restarted = [p for p, h in events.items()
                 if ("requeued", "multi_turn") in [(e["event"], e["reason"]) for e in h]]
    assert len(restarted) == 4
    _, saved = latest_checkpoint(tmp_path)
    assert set(restarted) <= {p.prompt_id for p in saved.reissue}
    cfg = config(tmp_path, steps=6, max_staleness=2)
    run(cfg, {0: HandingBack(0)}, [FakeTrainer(0)], resume=True, virtual=True)
    events = ledger(tmp_path)
    assert trained_once_or_unfinished(events)["trained"] == 6 * cfg.trainer.groups_per_step
    for prompt in restarted:  # the same attempt, from the start
        assert events[prompt][-1]["event"] == "trained" and events[prompt][-1]["attempt"] == 0


def test_an_engine_that_stops_itself_hands_its_rollouts_to_another(tmp_path: Path) -> None:
    """Engine 1 stops itself cleanly (``leave``) mid-run: its rollouts in progress come
    back, engine 0 (or engine 1's replacement) continues them, and engine 1 is
    replaced; nothing is lost or trained twice."""
    cfg = config(tmp_path, steps=6, max_staleness=2)
    engines = {0: HandingBack(0), 1: HandingBack(1)}
    left: list[int] = []

    async def leave_at_step_2(orchestrator: Orchestrator) -> None:
        while orchestrator.version < 2 or not engines[1].running:
            await anyio.sleep(0.001)
        left.append(await engines[1].leave())

    summary = run(cfg, dict(engines), [FakeTrainer(0)], beside=leave_at_step_2,
                  restart=lambda rank: HandingBack(rank), virtual=True)
    assert summary.steps == 6 and summary.restarts == summary.retired_workers == 1
    assert left and left[0] >= 1
    events = ledger(tmp_path)
    counts = trained_once_or_unfinished(events)
    assert counts["trained"] == 6 * cfg.trainer.groups_per_step
    handed = [p for p, h in events.items()
              if ("handed_back", "engine_stopped") in [(e["event"], e["reason"]) for e in h]]
    assert len(handed) == left[0]
    assert not engines[1].continued  # it continued nothing after leaving
    for prompt in handed:
        kinds = [(e["event"], e["reason"]) for e in events[prompt]]
        at = kinds.index(("handed_back", "engine_stopped"))
        assert kinds[at + 1:] == [("admitted", "continue"), ("generated", ""),
                                  ("trained", "")], kinds


def test_a_checkpoint_of_the_older_layout_without_partials_resumes(tmp_path: Path) -> None:
    """Written by engines that hand nothing back (what was in flight is owed), then
    stripped to the older layout (no partials or queue file): resumed on engines that
    can, it trains every prompt once."""
    cfg = config(tmp_path, steps=6, max_staleness=2)
    run(cfg, {0: FakeRollout(0)}, [FakeTrainer(0)], stop_after=3, virtual=True)
    folder, _ = latest_checkpoint(tmp_path)
    to_older_layout(folder)
    _, old = latest_checkpoint(tmp_path)
    assert old.partials == () and old.queue == ()
    second = run(cfg, {0: HandingBack(0)}, [FakeTrainer(0)], resume=True, virtual=True)
    assert second.steps == second.final_version == 6
    counts = trained_once_or_unfinished(ledger(tmp_path))
    assert counts["trained"] == 6 * cfg.trainer.groups_per_step


def test_a_worker_that_cannot_continue_generates_the_prompt_anew(tmp_path: Path) -> None:
    """Resumed on engines without ``HandsBack`` (the simulator's): each partial's prompt
    is generated from the start, and trained once."""
    partials, _ = stop_with_partials(tmp_path)
    cfg = config(tmp_path, steps=6, max_staleness=2)
    run(cfg, {0: FakeRollout(0)}, [FakeTrainer(0)], resume=True, virtual=True)
    events = ledger(tmp_path)
    assert trained_once_or_unfinished(events)["trained"] == 6 * cfg.trainer.groups_per_step
    for partial in partials:
        assert events[partial.prompt.prompt_id][-1]["event"] == "trained"
