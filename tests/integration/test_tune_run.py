"""`async-rl tune` on this machine: a real calibration run (real Ray, the real vLLM CPU
build, the tiny model), the simulator fitted to it, the search, real checks of the best
candidates, and a tuned.toml that loads back to a config with only tunable keys changed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from async_rl.cli import main
from async_rl.config_io import load_config
from async_rl.run.run_dir import read_summary
from async_rl.tuning import tune

pytestmark = pytest.mark.ray


def test_tune_calibrates_on_a_real_run_checks_its_best_candidates_and_writes_them(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # One real check of the best candidate (the command checks two): each check is a
    # run of its own, and one tests the path.
    monkeypatch.setattr(tune, "CHECKED", 1)
    job = tmp_path / "job.toml"
    job.write_text(f"""
[model]
path = "{tiny_model_dir}"
[task]
eval_size = 0
[rollout]
group_size = 4
max_new_tokens = 6
max_inflight_prompts = 2
[queue]
max_groups = 8
[staleness]
max_staleness = 1
[trainer]
groups_per_step = 4
micro_batch_tokens = 512
[run]
output_dir = "{tmp_path / 'run'}"
progress = false
""")
    out = tmp_path / "tuned.toml"
    # A short budget: the search then gets its least share (SEARCH_SHARE, 15 s) on one
    # core; how well it searches is the unit tier's (tests/unit/test_tune.py), the path is
    # this test's.
    assert main(["tune", str(job), "--budget-s", "60", "--out", str(out)]) == 0
    console = capsys.readouterr().out
    assert "measured groups/s" in console  # the candidates' table with the real checks

    folder = tmp_path / "run-tune"
    assert read_summary(folder / "calibration").steps == 1 + 1 + 8  # fill + 8 counted
    assert (folder / "calibration.toml").exists()  # this machine's fitted hardware file
    checks = sorted(folder.glob("check-*"))
    assert len(checks) == 1
    assert all(read_summary(check).groups_per_s > 0 for check in checks)

    base, tuned = load_config(job), load_config(out)
    # Never the algorithm, the batch or staleness above the config's own.
    assert tuned.trainer.groups_per_step == base.trainer.groups_per_step
    assert tuned.rollout.group_size == base.rollout.group_size
    assert tuned.trainer.lr == base.trainer.lr
    assert tuned.staleness.max_staleness <= base.staleness.max_staleness
    text = out.read_text()
    if tuned != base:  # each changed key says why, with its predicted and measured gain
        assert "# tuned:" in text and "predicted" in text and "measured" in text
    else:
        assert "no candidate beat the config" in console
