"""`async-rl compare` on the tiny model: ddp and fsdp2 on two shards, each shard in a
process of its own (no Ray), the same batch, agreeing in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from async_rl.cli import main


def test_compare_ddp_and_fsdp2_on_two_shards(tiny_model_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["compare", "--model", str(tiny_model_dir), "--shards", "2", "--steps", "1",
                   "--set", "trainer.groups_per_step=4", "--set", "rollout.group_size=4",
                   "--a", "trainer.backend=ddp", "--b", "trainer.backend=fsdp2", "--json"])
    assert status == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["agree"] is True
    assert [s["name"] for s in result["setups"]] == ["a", "b"]
    ddp, fsdp2 = result["setups"]
    for setup in (ddp, fsdp2):
        assert setup["step_s"] > 0 and setup["peak_rss_mb"] > 100
        assert len(setup["losses"]) == 2 and len(setup["peak_rss_mb_per_shard"]) == 2
    assert fsdp2["losses"] == pytest.approx(ddp["losses"], rel=1e-5, abs=1e-7)
    assert fsdp2["max_param_diff"] < 1e-5
