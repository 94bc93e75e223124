"""A mixture-of-experts policy end to end: examples/cpu_moe.toml itself, on real Ray, the
real vLLM CPU build and a tiny random Qwen3-MoE (``make-model --arch qwen3_moe``).

The example's own config, with only the model and the output directory changed: five
asynchronous steps train, each a new weight version the engine serves, with a finite
loss and a gradient (the example's shaped reward differs between a random policy's
samples); the trained router and experts differ from the initial ones; and at the
first step, whose samples the initial policy wrote, the trainer's log-probs of the
engine's tokens equal the engine's (importance weights 1): the MoE layers under the
trainer's packed forward agree with vLLM's.

Run synchronously (max_staleness 0) every step's samples come from the version it
trains, so importance weights are 1 at every step only if each version reached the
engine exactly: a Qwen3-MoE (whose experts the trainer holds fused, vLLM loads them so)
and a Mixtral (its experts fused and its MoE block renamed in memory, which vLLM
refuses: ``workers.trainer.engine_names`` sends the checkpoint's names), both through
the CPU build's repacking of reloaded experts (``workers.weights.gloo_transfer``).
The models are built here, not through the tests' model cache: a random build takes a
fraction of a second.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_async_grpo import check_ledger
from transformers import AutoModelForCausalLM

from async_rl.api import train
from async_rl.config_io import load_config
from async_rl.models.families import build_family_model
from async_rl.run.run_dir import FINAL_MODEL, read_metrics

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "cpu_moe.toml"
STEPS = 5


def test_the_cpu_moe_example_trains_five_asynchronous_steps(
    tmp_path: Path, ray_shutdown: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO)  # the example names its reward file from the repository root
    model = build_family_model("qwen3_moe", tmp_path / "moe-model")
    out = tmp_path / "run"
    config = load_config(EXAMPLE, {"model.path": str(model), "run.output_dir": str(out),
                                   "run.progress": False})
    assert config.run.num_steps == STEPS and config.staleness.max_staleness > 0

    summary = train(config)

    assert summary.stopped == "" and summary.steps == summary.final_version == STEPS
    check_ledger(out, STEPS * config.trainer.groups_per_step)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert sum(r["grad_norm"] > 0 for r in rows) >= STEPS - 1
    assert max(r["staleness_max"] for r in rows) >= 1  # asynchronous: stale samples trained
    first = rows[0]
    assert first["staleness_max"] == 0
    assert first["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert abs(first["kl_behaviour"]) < 1e-5

    before = dict(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    after = dict(AutoModelForCausalLM.from_pretrained(out / FINAL_MODEL).named_parameters())
    assert before.keys() == after.keys()
    moe = [name for name in before if ".mlp.gate." in name or ".mlp.experts." in name]
    assert len(moe) >= 2 * 2  # every layer's router and experts
    changed = [name for name in moe if not torch.equal(before[name], after[name])]
    assert changed == moe


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_every_moe_version_reaches_the_engine_exactly(
    arch: str, tmp_path: Path, ray_shutdown: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO)
    model = build_family_model(arch, tmp_path / "model")
    out = tmp_path / "run"
    config = load_config(EXAMPLE, {"model.path": str(model), "run.output_dir": str(out),
                                   "run.progress": False, "staleness.max_staleness": 0})

    summary = train(config)

    assert summary.stopped == "" and summary.steps == summary.final_version == STEPS
    rows = read_metrics(out)
    assert len(rows) == STEPS
    for row in rows:
        assert row["staleness_max"] == 0 and row["grad_norm"] > 0, row
        # 0.08 above 1 from step 2 on without the repacking (vLLM 0.32)
        assert row["is_weight_max"] == pytest.approx(1.0, abs=1e-4), row
        assert abs(row["kl_behaviour"]) < 1e-5, row
