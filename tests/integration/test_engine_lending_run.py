"""Rollout engines join and leave a real run under ``[autopilot]`` (real Ray, the real vLLM
CPU build, the long-tail model): from one engine at two prompts in flight the trainer
waits for data, and the autopilot's own rule adds a second engine
(autopilot.max_rollout_workers = 2, the in-flight prompts no key, so the engine count is
the one move left). Its removal is forced: the judgement's noise band is patched so that
the next window reverts the move (whether a second engine pays on two cores is not
something a test can count on). Checked: the added engine generated at the version it
was added at or later, the removed engine's rollouts in progress (as many as it held
when its removal began, none when it was idle then) were handed back (or re-queued with
the reason) and trained once, metrics.jsonl has the engine count every
step, the ledger is whole (every prompt trained once), the worker registry
(workers.json, and report's lines) has the engine's row, added and removed after their
steps, and the run's last checkpoint keeps the engine count a resume starts from."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from async_rl.analysis.report import autopilot_lines
from async_rl.config_io import decode_config
from async_rl.control import autopilot
from async_rl.control.checkpoint_files import latest_checkpoint
from async_rl.control.failures import RolloutFailed
from async_rl.run.run_dir import read_ledger, read_metrics, read_record, read_workers
from async_rl.shell.adapters import RayRollout
from async_rl.shell.lending import LEAVING, RayLending
from async_rl.shell.ray_shell import run_training
from async_rl.tasks.longtail import MAX_NEW_TOKENS
from buffers.common.partials import PartialGroup
from buffers.common.records import Group, Prompt

pytestmark = pytest.mark.ray

ENGINES = "rollout.num_workers"
STEPS = 10
GROUPS_PER_STEP = 4


def test_an_engine_joins_at_the_current_version_and_a_leaving_ones_prompts_are_requeued(
        longtail_model_dir: Path, tmp_path: Path, ray_shutdown: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, int, str]] = []
    """(engine, prompt id, the group's oldest token version or -1, "handed back" or the
    failure's reason or "")"""
    generate = RayRollout.generate

    async def spied(self: RayRollout, prompt: Prompt) -> Group | PartialGroup:
        if in_progress and self.name == "rollout-1":  # reached it after its removal began
            late.append(prompt.prompt_id)
        try:
            group = await generate(self, prompt)
        except RolloutFailed as failed:
            calls.append((self.name, prompt.prompt_id, -1, failed.reason))
            raise
        handed = "handed back" if isinstance(group, PartialGroup) else ""
        calls.append((self.name, prompt.prompt_id, group.min_version, handed))
        return group

    monkeypatch.setattr(RayRollout, "generate", spied)
    in_progress: list[int] = []
    """The removed engine's calls in progress as its removal began."""
    late: list[str] = []
    """Its calls whose request reached it after that (sent before the pool let it go)."""
    stop = RayLending._stop

    async def counted_stop(self: RayLending, rank: int) -> None:
        in_progress.append(self.added[rank].calls if rank in self.added else 0)
        await stop(self, rank)

    monkeypatch.setattr(RayLending, "_stop", counted_stop)
    # Every judged move falls beyond its band: the engine added is taken back.
    monkeypatch.setattr(autopilot, "noise_band", lambda before, after: -1e9)

    run_dir = tmp_path / "run"
    config = decode_config({
        "model": {"path": str(longtail_model_dir)},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"group_size": 4, "max_new_tokens": MAX_NEW_TOKENS,
                    "max_inflight_prompts": 2},
        "staleness": {"max_staleness": 2},
        "trainer": {"groups_per_step": GROUPS_PER_STEP, "micro_batch_tokens": 512},
        "run": {"num_steps": STEPS, "output_dir": str(run_dir), "progress": False,
                "eval_every": 0},
        "autopilot": {"enabled": True, "every_steps": 2, "max_rollout_workers": 2,
                      "keys": ["trainer.micro_batch_tokens"]},
    })
    summary = run_training(config)
    assert summary.steps == STEPS

    # The autopilot added the engine after step 3 (step 1 fills the pipeline: steps 2-3
    # make the first window); the steps that trained what was queued during its start
    # are in no window, and the patched judgement took it back after the next one.
    record = read_record(run_dir)
    assert record is not None
    moves = [(c.step, c.key, c.old, c.new, c.outcome, c.judged_step)
             for c in record.autopilot]
    assert moves[:1] == [(3, ENGINES, 1, 2, "reverted", moves[0][-1])], moves
    removed = moves[0][-1]
    assert 5 <= removed < STEPS, moves
    assert "trainer waited" in record.autopilot[0].cause
    rows = read_metrics(run_dir)
    assert [row[f"autopilot/{ENGINES}"] for row in rows] == (
        [1] * 3 + [2] * (removed - 3) + [1] * (STEPS - removed))

    # The registry: the engine's own row, where it ran and when it came and went; the
    # last checkpoint keeps the engine count (a resume starts with as many).
    registry = read_workers(run_dir)
    lent = [w for w in registry if w.name == "rollout-1"]
    assert [(w.added_after_step, w.removed_after_step) for w in lent] == [(3, removed)]
    assert lent[0].pid > 0 and lent[0].devices and lent[0].node
    assert all(w.added_after_step == -1 for w in registry if w.name != "rollout-1")
    assert any(line.strip().startswith("rollout-1: ") and
               line.endswith(f"added after step 3, removed after step {removed}")
               for line in autopilot_lines(record, registry)), autopilot_lines(record, registry)
    _, saved = latest_checkpoint(run_dir)
    assert saved.autopilot is not None and saved.autopilot.values[ENGINES] == 1

    # The added engine generated from the version it was added at (after step 3: 3).
    added = [c for c in calls if c[0] == "rollout-1"]
    assert added, calls
    made = [version for _, _, version, reason in added if not reason]
    assert made and min(made) >= 3, added

    # Its rollouts in progress when it left were handed back (continued by the other
    # engine) or, where the hand-back did not reach them, failed and were re-queued; one
    # that finished as the leave arrived trained as it was. The engine may also have
    # been idle then (the staleness gate shut, or its prompts done): whether it held any
    # is timing, so the count is checked, not assumed (a clean stop with rollouts
    # certainly in progress: test_failures.py).
    left = {pid for _, pid, _, how in added if how in ("handed back", LEAVING)}
    print(f"the removed engine's calls in progress: {in_progress} (and {len(late)} "
          f"reaching it later); handed back or re-queued: {len(left)}")
    assert len(in_progress) == 1 and len(left) <= in_progress[0] + len(late), (
        in_progress, late, added)
    assert all(how in ("", "handed back", LEAVING) for *_, how in calls), calls
    entries = read_ledger(run_dir)
    back = {e.prompt_id for e in entries
            if (e.event, e.reason) in (("handed_back", "engine_stopped"),
                                       ("failed", f"rollout_error:{LEAVING}"))}
    assert back == left

    # The ledger is whole: every step's groups trained once, none twice; every prompt
    # admitted ends trained, or still owed at the end (unfinished, or re-queued).
    trained = Counter(e.prompt_id for e in entries if e.event == "trained")
    assert sum(trained.values()) == STEPS * GROUPS_PER_STEP
    assert max(trained.values()) == 1
    last: dict[str, str] = {}
    for entry in entries:
        last[entry.prompt_id] = entry.event
    assert left <= set(last)
    assert set(last.values()) <= {"trained", "unfinished", "failed", "dropped",
                                  "handed_back"}, last
    for pid in left & set(trained):
        events = [e.event for e in entries if e.prompt_id == pid]
        assert max(events.index(ev) for ev in ("handed_back", "failed") if ev in events) \
            < events.index("trained")
