"""[autopilot] on a real run: real Ray, the real vLLM CPU build, the tiny long-tail model.

From one prompt in flight the trainer waits for data: the autopilot raises
rollout.max_inflight_prompts on the live rollout pool (past what the run started with,
within the ceiling its rollout actor was made for) and says so in every place: the
console, metrics.jsonl, run.json and the report.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from async_rl.analysis.report import print_report
from async_rl.analysis.tables import wide_console
from async_rl.config_io import decode_config
from async_rl.run.run_dir import read_metrics, read_record
from async_rl.shell.ray_shell import run_training
from async_rl.tasks.longtail import MAX_NEW_TOKENS

pytestmark = pytest.mark.ray

INFLIGHT = "rollout.max_inflight_prompts"
STEPS = 7


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_starved_trainer_gets_more_prompts_in_flight_and_every_place_says_so(
        longtail_model_dir: Path, tmp_path: Path, ray_shutdown: None) -> None:
    run_dir = tmp_path / "run"
    config = decode_config({
        "model": {"path": str(longtail_model_dir)},
        "task": {"kind": "longtail", "eval_size": 8},
        "rollout": {"group_size": 4, "max_new_tokens": MAX_NEW_TOKENS,
                    "max_inflight_prompts": 1},
        "queue": {"max_groups": 8},
        "trainer": {"groups_per_step": 4, "micro_batch_tokens": 512},
        "run": {"num_steps": STEPS, "output_dir": str(run_dir), "progress": False,
                "eval_every": 0},
        "autopilot": {"enabled": True, "every_steps": 2, "keys": [INFLIGHT]},
    })
    lines = Lines()
    logger = logging.getLogger("async_rl.control.live_tuning")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        summary = run_training(config)
    finally:
        logger.removeHandler(lines)
    assert summary.steps == STEPS

    record = read_record(run_dir)
    assert record is not None and len(record.autopilot) >= 1
    first = record.autopilot[0]
    # The first step (the fill) is in no window: steps 2-3 make the first.
    assert (first.key, first.old, first.new, first.step) == (INFLIGHT, 1, 2, 3)
    assert "trainer waited" in first.cause and "for data" in first.cause

    columns = [row[f"autopilot/{INFLIGHT}"] for row in read_metrics(run_dir)]
    assert len(columns) == STEPS
    assert columns[:3] == [1, 1, 1] and columns[3] == 2

    assert any(line.startswith(f"autopilot after step 3: {INFLIGHT} 1 -> 2: trainer waited")
               for line in lines.lines), lines.lines

    console = wide_console()
    with console.capture() as captured:
        print_report(run_dir, console)
    assert f"after step 3: {INFLIGHT} 1 -> 2" in captured.get()
