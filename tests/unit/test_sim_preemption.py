"""simulate.preemption_step: what a stop at the end of a step keeps and loses, counted
by hand on a fake run, and as invariants on simulated ones (kept + lost + trained =
generated; the probe changes nothing; degenerate runs)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from async_rl.analysis.results import stop_cost_line
from async_rl.api import simulate
from async_rl.config import Config
from async_rl.run.run_dir import read_metrics, read_summary
from async_rl.sim.preemption import Preemption
from buffers.common.config import ConfigError
from tests.unit.test_simulate_setups import config, stats

LENGTH, SAMPLES = 50, 4
GROUP = LENGTH * SAMPLES
"""Every simulated group's completion tokens (empirical lengths of one value)."""


def run_config(out: Path, *, step: int, workers: int = 2, staleness: int = 4,
               max_groups: int = 64, steps: int = 6) -> Config:
    """Every completion LENGTH tokens, groups of SAMPLES, 2 groups a step."""
    base = config(out, workers=workers, groups=2, steps=steps, preemption_step=step,
                  lengths="empirical", length_values=[LENGTH])
    return msgspec.structs.replace(
        base, staleness=msgspec.structs.replace(base.staleness, max_staleness=staleness),
        queue=msgspec.structs.replace(base.queue, max_groups=max_groups))


# ---- by hand: a fake run at the instant of the stop ----------------------------------


def request(lengths: tuple[int, ...], *, joined: int | None, done: bool = False) -> Any:
    """A request as the engine keeps it: joined at step ``joined`` (None: waiting)."""
    return SimpleNamespace(lengths=lengths, max_version=0 if done else -1,
                           min_version=-1 if joined is None else 0,
                           finish=(joined or 0) + max(lengths))


def group(prompt_id: str, min_version: int) -> Any:
    return SimpleNamespace(prompt=SimpleNamespace(prompt_id=prompt_id, attempt=0),
                           min_version=min_version)


@pytest.mark.parametrize("hands_back", [True, False])
def test_counts_by_hand(hands_back: bool) -> None:
    """A single-turn task's stop hands the rollout in flight back (its 14 tokens kept); a
    multi-turn one's restarts it (lost). The finished group waiting for its reward is
    lost either way: a stop does not wait for it."""
    now = [10.0]
    probe = Preemption(3, lambda: now[0], hands_back=hands_back)
    engine0: Any = SimpleNamespace(step_now=lambda: 30)
    engine1: Any = SimpleNamespace(step_now=lambda: 7)
    now[0] = 0.0
    probe.submitted(("trained", 0), engine0, 0, request((40, 40), joined=0, done=True))
    probe.submitted(("q-fresh", 0), engine0, 0, request((10, 20), joined=0, done=True))
    probe.submitted(("q-stale", 0), engine1, 1, request((5, 5), joined=0, done=True))
    # In flight at step 30 of engine 0: joined at 20, lengths 4 and 50 -> 4 + 10 tokens.
    probe.submitted(("running", 0), engine0, 0, request((4, 50), joined=20))
    probe.submitted(("waiting", 0), engine1, 1, request((9,), joined=None))
    # Finished on engine 1, its group not yet in the queue (reward, or queue room).
    probe.submitted(("rewarding", 0), engine1, 1, request((6, 6), joined=0, done=True))
    now[0] = 10.0
    owed = [SimpleNamespace(prompt_id=key, attempt=0)
            for key in ("running", "waiting", "rewarding", "requeued", "q-fresh")]
    queue = SimpleNamespace(max_staleness=1,
                            snapshot=lambda: SimpleNamespace(
                                items=[group("q-fresh", 4), group("q-stale", 2)]))
    orchestrator: Any = SimpleNamespace(queue=queue, version=4,
                                   prompts=SimpleNamespace(owed=lambda: owed))
    cost = probe.take(orchestrator, 2)
    generated = 80 + 30 + 10 + 14 + 0 + 12
    assert cost.generated_tokens == generated
    assert cost.tokens_per_s == pytest.approx(generated / 10.0)
    assert (cost.kept_groups, cost.kept_tokens) == (2, 40)
    assert (cost.stale_groups, cost.stale_tokens) == (1, 10)  # 4 - 2 > 1
    assert cost.owed_prompts == 4  # the queued one is kept, not owed
    handed, lost = (14, 12) if hands_back else (0, 14 + 12)
    assert (cost.handed_back_rollouts, cost.handed_back_tokens) == (int(hands_back), handed)
    assert (cost.lost_rollouts, cost.lost_tokens) == (2 - int(hands_back), lost)
    assert cost.engine_lost_tokens == (14, 12)  # an engine's death loses both
    assert cost.done_tokens == 80
    assert cost.lost_s == pytest.approx(lost / cost.tokens_per_s)
    assert cost.handed_back_s == pytest.approx(handed / cost.tokens_per_s)
    assert cost.regenerated == pytest.approx((lost + 10) / (40 + 26))
    line = stop_cost_line(cost)
    assert "2 queued groups, 40 tokens" in line and "1 too stale" in line
    assert f"hands back {int(hands_back)} in-flight rollouts, {handed} tokens" in line
    assert "at most 14 tokens" in line


def test_nothing_generated_counts_zero() -> None:
    probe = Preemption(1, lambda: 0.0)
    queue = SimpleNamespace(max_staleness=0,
                            snapshot=lambda: SimpleNamespace(items=[]))
    orchestrator: Any = SimpleNamespace(queue=queue, version=1,
                                   prompts=SimpleNamespace(owed=lambda: []))
    cost = probe.take(orchestrator, 1)
    assert (cost.generated_tokens, cost.kept_tokens, cost.lost_tokens) == (0, 0, 0)
    assert cost.tokens_per_s == 0.0 and cost.regenerated == 0.0
    assert cost.engine_lost_tokens == (0,)


# ---- simulated runs -------------------------------------------------------------------


@pytest.mark.parametrize(("workers", "staleness", "max_groups"),
                         [(2, 4, 64), (1, 4, 64), (2, 4, 2), (1, 0, 64)])
def test_every_token_is_trained_kept_or_lost(tmp_path: Path, workers: int, staleness: int,
                                             max_groups: int) -> None:
    step = 3
    simulate(run_config(tmp_path / "r", step=step, workers=workers, staleness=staleness,
                        max_groups=max_groups), overwrite=True)
    cost = stats(tmp_path / "r").stop
    assert cost is not None and (cost.step, cost.version) == (step, step)
    # No drops at this staleness: the done tokens are the trained groups' exactly.
    assert read_summary(tmp_path / "r").dropped_stale == 0
    assert cost.done_tokens == step * 2 * GROUP
    assert cost.generated_tokens == (cost.done_tokens + cost.kept_tokens
                                     + cost.handed_back_tokens + cost.lost_tokens)
    assert cost.kept_tokens == cost.kept_groups * GROUP
    assert cost.kept_groups <= max_groups
    assert cost.stale_groups == 0  # every queued group is within 4 versions
    assert 0 <= cost.lost_tokens <= cost.lost_rollouts * GROUP
    assert 0 <= cost.handed_back_tokens <= cost.handed_back_rollouts * GROUP
    assert cost.lost_rollouts + cost.handed_back_rollouts <= cost.owed_prompts
    assert len(cost.engine_lost_tokens) == workers
    assert sum(cost.engine_lost_tokens) == cost.lost_tokens + cost.handed_back_tokens
    assert cost.kept_s == pytest.approx(cost.kept_tokens / cost.tokens_per_s)
    if staleness == 0:  # admission waits for each version: nothing open after a step
        assert (cost.kept_groups, cost.owed_prompts, cost.lost_tokens,
                cost.handed_back_tokens) == (0, 0, 0, 0)
    else:
        assert cost.kept_groups + cost.owed_prompts > 0


def test_a_long_tail_holds_work_in_both_places(tmp_path: Path) -> None:
    """Lengths with a tail: at the stop some groups wait in the queue while long ones
    are still being generated."""
    base = config(tmp_path / "r", workers=2, groups=4, steps=8, preemption_step=4)
    simulate(msgspec.structs.replace(base, staleness=msgspec.structs.replace(
        base.staleness, max_staleness=2)), overwrite=True)
    cost = stats(tmp_path / "r").stop
    assert cost is not None
    assert cost.kept_groups > 0 and cost.handed_back_tokens > 0
    assert 0 <= cost.regenerated < 1


def test_the_probe_changes_nothing(tmp_path: Path) -> None:
    simulate(run_config(tmp_path / "off", step=0), overwrite=True)
    simulate(run_config(tmp_path / "on", step=2), overwrite=True)
    assert stats(tmp_path / "off").stop is None
    assert stats(tmp_path / "on").stop is not None
    off, on = read_metrics(tmp_path / "off"), read_metrics(tmp_path / "on")
    assert len(off) == len(on) == 6
    assert off == on
    assert (read_summary(tmp_path / "off").wall_s == read_summary(tmp_path / "on").wall_s)


def test_the_last_step_and_past_it(tmp_path: Path) -> None:
    simulate(run_config(tmp_path / "last", step=6), overwrite=True)
    cost = stats(tmp_path / "last").stop
    assert cost is not None and cost.step == 6
    assert cost.done_tokens == 6 * 2 * GROUP
    with pytest.raises(ConfigError, match=r"simulate\.preemption_step = 7"):
        simulate(run_config(tmp_path / "past", step=7), overwrite=True)
