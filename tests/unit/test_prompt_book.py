"""The prompt book and the verdict on a generated group: what each turn of a prompt's
life writes to the ledger, counts and gives back to the gate — a stale drop from the
queue, a step that trained nothing (none of its groups, or all of them), a group re-queued
or filtered by its verdict — and the verdict's rules themselves."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from orchestrator_fakes import config, ledger

from async_rl.control.prompt_book import PromptBook
from async_rl.control.prompt_ledger import PromptLedger
from async_rl.control.run_health import RunHealth
from async_rl.control.step_metrics import StepTotals
from async_rl.control.step_stages import CRITIC_WARMUP
from async_rl.run.run_dir import RunWriter
from async_rl.tasks.sources import ArithmeticTask
from buffers.common.records import Group, Prompt, Sample, make_group
from buffers.plan.group_verdict import (
    ENV_TIMEOUT,
    TOO_FEW_MEMBERS,
    GroupRules,
    GroupVerdict,
    group_verdict,
)
from buffers.queue.queue_records import DROP_STALE, Dropped
from buffers.queue.staleness import AdmissionGate
from workers.trainer.config import TrainerConfig


def group(prompt: Prompt, rewards: tuple[float, ...] = (0.0, 1.0), *,
          failed: int | None = None) -> Group:
    samples = tuple(Sample(token_ids=(5, 6), logprobs=(-0.5, -0.5), versions=(0, 0),
                           finish_reason="stop", text="x", reward=r,
                           reward_failed=k == failed) for k, r in enumerate(rewards))
    return make_group(prompt, (1, 2), samples)


class Book:
    """A book over a real ledger in ``tmp_path``, with ``admitted`` prompts in flight
    (each holding a gate slot)."""

    def __init__(self, tmp_path: Path, admitted: int, *, max_readmissions: int = 4) -> None:
        cfg = config(tmp_path)
        self.path = tmp_path
        self.out = RunWriter(tmp_path, cfg)
        self.gate = AdmissionGate(groups_per_step=admitted, max_staleness=0)
        self.totals = StepTotals()
        self.prompts = PromptLedger(self.out, lambda: 0, max_readmissions=max_readmissions)
        self.book = PromptBook(ArithmeticTask(seed=0), self.prompts, self.gate, self.totals,
                               RunHealth(self.totals, max_nonfinite_steps=3,
                                         stall_timeout_s=60.0, max_filtered_in_a_row=10))
        self.admitted = [self.admit() for _ in range(admitted)]

    def admit(self) -> Prompt:
        assert self.gate.try_acquire()
        return self.book.admit()

    def events(self) -> list[tuple[str, str]]:
        return [(str(e["event"]), str(e["reason"])) for history in ledger(self.path).values()
                for e in history if e["event"] != "admitted"]


def test_a_stale_drop_gives_the_slot_back_and_runs_the_prompt_again(tmp_path: Path) -> None:
    book = Book(tmp_path, 1)
    assert book.gate.open_slots == 0
    stale = group(book.admitted[0])
    book.book.on_drop(Dropped(prompt_id=stale.prompt_id, reason=DROP_STALE,
                                 min_version=0, at_version=3, item=stale))
    assert book.gate.open_slots == 1 and book.totals.dropped_stale == 1
    assert book.events() == [("dropped", DROP_STALE), ("requeued", DROP_STALE)]
    assert book.book.admit().attempt == 1  # the re-queued prompt comes first


def test_an_empty_untrained_step_changes_nothing(tmp_path: Path) -> None:
    book = Book(tmp_path, 2)
    book.book.untrained([], "samples_lost")
    assert book.events() == [] and book.gate.open_slots == 0
    assert len(book.prompts.open) == 2


@pytest.mark.parametrize(("reason", "event"), [("nonfinite", "failed"),
                                               (CRITIC_WARMUP, "dropped")])
def test_a_step_that_trained_none_runs_every_group_again(tmp_path: Path, reason: str,
                                                         event: str) -> None:
    book = Book(tmp_path, 3)
    book.book.untrained([group(p) for p in book.admitted], reason)
    assert book.gate.open_slots == 3
    assert book.events() == [(event, reason), ("requeued", reason)] * 3
    assert not book.prompts.open and len(book.prompts.requeued) == 3


def test_past_max_readmissions_a_prompt_is_dropped_for_good(tmp_path: Path) -> None:
    book = Book(tmp_path, 1, max_readmissions=0)
    book.book.untrained([group(book.admitted[0])], "nonfinite")
    assert book.totals.readmissions_exhausted == 1 and not book.prompts.requeued


def test_a_verdict_to_requeue_counts_and_gives_the_slot_back(tmp_path: Path) -> None:
    book = Book(tmp_path, 1)
    prompt = book.admitted[0]
    verdict = GroupVerdict(group=group(prompt, (1.0,)), requeue=TOO_FEW_MEMBERS)
    assert not book.book.generated(prompt, verdict)
    assert book.totals.too_few_members == 1 and book.totals.groups_generated == 1
    assert book.gate.open_slots == 1
    assert book.events() == [("generated", ""), ("dropped", TOO_FEW_MEMBERS),
                             ("requeued", TOO_FEW_MEMBERS)]


def test_a_filtered_group_is_done_and_a_kept_one_holds_its_slot(tmp_path: Path) -> None:
    book = Book(tmp_path, 2)
    flat, kept = book.admitted
    assert not book.book.generated(flat, GroupVerdict(group=group(flat, (1.0, 1.0)),
                                                      informative=False))
    assert book.book.generated(kept, GroupVerdict(group=group(kept), informative=True))
    assert book.totals.filtered_groups == 1 and book.gate.open_slots == 1
    assert list(book.prompts.open) == [kept.prompt_id] and not book.prompts.requeued
    assert ("dropped", "filtered") in book.events()


def rules(**keys: bool) -> GroupRules:
    return GroupRules(trainer=TrainerConfig(), **keys)


def test_the_verdict_takes_lost_scores_back_on_request() -> None:
    prompt = Prompt(prompt_id="p", text="", answer="")
    lost = group(prompt, (1.0, 0.0, 1.0), failed=1)
    assert len(group_verdict(lost, rules()).group.members) == 2
    zeroed = group_verdict(lost, rules(zero_reward_failures=True))
    assert len(zeroed.group.members) == 3 and zeroed.queued


def test_the_verdict_requeues_env_timeouts_and_lone_members() -> None:
    prompt = Prompt(prompt_id="p", text="", answer="")
    timed_out = msgspec.structs.replace(group(prompt), env_timeouts=1)
    assert group_verdict(timed_out, rules()).queued
    assert group_verdict(timed_out, rules(requeue_env_timeouts=True)).requeue == ENV_TIMEOUT
    alone = group_verdict(group(prompt, (1.0,)), rules(filter_groups=True))
    assert alone.requeue == TOO_FEW_MEMBERS and alone.informative is None


def test_the_filter_judges_only_when_asked() -> None:
    prompt = Prompt(prompt_id="p", text="", answer="")
    flat = group(prompt, (1.0, 1.0))
    assert group_verdict(flat, rules()).informative is None
    judged = group_verdict(flat, rules(filter_groups=True))
    assert judged.informative is False and not judged.queued
    assert group_verdict(group(prompt), rules(filter_groups=True)).informative
