"""bench/races/tool_latency.py without training: its per-run configs and the mean number of
trajectories in flight read from a prompt ledger."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_modules import load_script

from async_rl.config_io import decode_config
from buffers.common.reports import LedgerEntry

bench = load_script("bench/races/tool_latency.py", "tool_latency")


def entry(prompt_id: str, event: str, time: float, attempt: int = 0) -> LedgerEntry:
    return LedgerEntry(prompt_id=prompt_id, event=event, version=0, attempt=attempt, time=time)


def test_in_flight_is_summed_generation_time_over_the_window_times_group_size() -> None:
    ledger = [entry("a", "admitted", 0.0), entry("b", "admitted", 1.0),
              entry("a", "generated", 2.0), entry("a", "trained", 2.5),
              entry("b", "generated", 4.0),
              # a prompt run again counts again, its second attempt on its own
              entry("a", "admitted", 2.0, attempt=1), entry("a", "generated", 3.0, attempt=1)]
    # (2 + 3 + 1) seconds of generation over the 4 s from first admission to last
    assert bench.mean_in_flight(ledger, group_size=8) == pytest.approx(8 * 6 / 4)
    assert bench.mean_in_flight([entry("a", "admitted", 0.0)], group_size=8) == 0.0


def test_each_run_sets_latency_bound_and_its_own_directory(tmp_path: Path) -> None:
    base = decode_config({"model": {"path": "m"}, "task": {"kind": "calculator"},
                          "weights": {"sync_every": 1}})
    configs = [bench.run_config(base, latency, eta, 5, tmp_path)
               for latency in bench.LATENCIES_MS for eta in (0, 2)]
    assert len(configs) == 6
    assert [(c.task.tool_latency_ms, c.staleness.max_staleness) for c in configs] == [
        (0.0, 0), (0.0, 2), (50.0, 0), (50.0, 2), (200.0, 0), (200.0, 2)]
    assert len({c.run.output_dir for c in configs}) == 6
    assert all(c.task.eval_size == 0 and c.run.num_steps == 5 for c in configs)
