"""The simulator's PPO roles and LoRA: the reference's and the critic's passes take the
trainer shard's devices (and show as the real run's idle causes), and a LoRA version
carries the adapters' bytes alone (no Ray: the orchestrator on a virtual clock)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest
from transformers import Qwen2Config

from async_rl.analysis.report import idle_of, read_spans
from async_rl.api import simulate
from async_rl.cli import main
from async_rl.config import Config
from async_rl.run.run_dir import read_metrics
from async_rl.sim.calibrate import calibrate
from async_rl.sim.costs import Costs, ModelShape, adapter_parameters
from async_rl.sim.hardware_file import load_hardware
from async_rl.sim.roles import step_passes
from async_rl.sim.run import simulation_costs
from buffers.common.config import ConfigError
from workers.common.spans import BUSY
from workers.model_config import LORA_TARGETS, LoraConfig, lora_features
from workers.weights.adapter import adapter_shapes

QWEN_05B = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "tie_word_embeddings": True}
"""Qwen2.5-0.5B's config.json numbers."""
SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def model_dir(tmp_path: Path, shape: dict[str, int]) -> Path:
    """A model folder with a config.json only (nothing allocated)."""
    folder = tmp_path / "model"
    Qwen2Config(**shape).save_pretrained(folder)
    return folder


def config(out: Path, *, steps: int = 8, cores: int = 0,
           **sections: dict[str, object]) -> Config:
    """Every completion 30 tokens and every prompt 16, so each step's micro-batches are
    the same whichever groups it takes: step times compare across runs. ``sections``:
    keys replaced in each named section."""
    raw: dict[str, dict[str, object]] = {
        "model": {"path": "not-needed"},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"num_workers": 2, "group_size": 4, "max_new_tokens": 64,
                    "max_inflight_prompts": 8},
        "queue": {"max_groups": 64, "bucket_edges": [128, 512]},
        "staleness": {"max_staleness": 1},
        "trainer": {"num_shards": 1, "groups_per_step": 8, "micro_batch_tokens": 256},
        "run": {"num_steps": steps, "output_dir": str(out), "progress": False,
                "eval_every": 0, "record_spans": True},
        "simulate": {"parameters": 4.0e7, "kv_bytes_per_token": 4096,
                     "lengths": "empirical", "length_values": [30], "prompt_tokens": 16,
                     "hardware": "h100",
                     "hardware_overrides": {"call_s": 0.002, "cores": cores}},
    }
    for section, keys in sections.items():
        raw[section] = {**raw.get(section, {}), **keys}
    return msgspec.convert(raw, Config)


def train_s(run_dir: Path) -> list[float]:
    rows = read_metrics(run_dir)
    assert len(rows) >= 4
    return [float(r["train_s"]) for r in rows]


# ---- the adapters' size ------------------------------------------------------------------

@pytest.mark.parametrize("targets", [LORA_TARGETS, ("q_proj", "v_proj"), ("down_proj",),
                                     ("o_proj", "lm_head")])
def test_the_adapter_count_from_config_json_is_peft_s(tmp_path: Path,
                                                      targets: tuple[str, ...]) -> None:
    folder = model_dir(tmp_path, {**SMALL, "head_dim": 24})  # head_dim apart from hidden
    lora = LoraConfig(rank=4, target_modules=targets)
    shapes = adapter_shapes(str(folder), lora)
    assert len(shapes) == 2 * sum(2 if t != "lm_head" else 1 for t in targets)
    counted = sum(math.prod(s) for s in shapes.values())
    assert adapter_parameters(str(folder), lora) == counted
    features = lora_features(json.loads((folder / "config.json").read_text()))
    assert lora.rank * sum(features[t] for t in targets) == counted


def test_a_rank_8_version_of_a_half_billion_model_carries_its_adapters_alone(
        tmp_path: Path) -> None:
    folder = model_dir(tmp_path, QWEN_05B)
    # 24 layers x 8 x (2x(896+896) + 2x(896+128) + 3x(896+4864)), as tests/unit/test_lora.py.
    assert adapter_parameters(str(folder), LoraConfig(rank=8)) == 4_399_104
    # Given per rank, the count is rank x it, with or without a config.json.
    assert adapter_parameters("not-there", LoraConfig(rank=16), 549_888) == 16 * 549_888


def test_lora_without_a_shape_or_on_unknown_modules_is_one_line_naming_the_key(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.lora.rank = 8: .*no config.json.*"
                                          r"simulate.lora_parameters_per_rank"):
        adapter_parameters("not-there", LoraConfig(rank=8))
    folder = model_dir(tmp_path, SMALL)
    with pytest.raises(ConfigError, match=r"model.lora.target_modules = .*\['qkv'\] not"):
        adapter_parameters(str(folder), LoraConfig(rank=8, target_modules=("q_proj", "qkv")))
    bad = config(tmp_path / "run", model={"path": "not-there", "lora": {"rank": 8}})
    with pytest.raises(ConfigError, match=r"simulate\.lora_parameters_per_rank"):
        simulate(bad)


def test_a_lora_version_and_its_gradients_are_the_adapters_bytes() -> None:
    hardware = load_hardware("h100")
    full = Costs(hardware, ModelShape(parameters=5e8, kv_bytes_per_token=1e4,
                                      bytes_per_parameter=2.0))
    lora = Costs(hardware, ModelShape(parameters=5e8, kv_bytes_per_token=1e4,
                                      bytes_per_parameter=2.0, adapter_parameters=4.4e6))
    assert lora.version_bytes == 4.4e6 * 2 and full.version_bytes == full.weight_bytes == 1e9
    assert lora.weight_bytes == full.weight_bytes  # the engine still reads every weight
    assert lora.decode_step(8, 1e3) == full.decode_step(8, 1e3)
    wire = hardware.interconnect_bandwidth
    assert lora.transfer(1) == pytest.approx(8.8e6 / wire + hardware.weight_member_s)
    assert lora.publish() < full.publish() and lora.reload() < full.reload()
    ring = 2 * (4 - 1) / 4 * 4  # fp32 gradients over a ring of 4 shards, per parameter
    link = wire * hardware.devices_per_trainer_shard
    assert lora.update(4) == pytest.approx(hardware.update_s + ring * 4.4e6 / link)
    # The critic trains every weight: its all-reduce is the whole model's.
    assert lora.update(4, 5e8) == full.update(4)
    assert lora.update(1) == full.update(1) == hardware.update_s
    assert full.forward_pass([30, 40]) == pytest.approx(full.micro_batch([30, 40]) / 3)


# ---- simulated runs -------------------------------------------------------------------------

def test_the_reference_and_the_critic_lengthen_each_step_by_their_passes(
        tmp_path: Path) -> None:
    runs = {"grpo": {}, "kl": {"trainer": {"kl_coef": 0.1}},
            "gae": {"algorithm": {"advantage": "gae"}},
            "ppo": {"algorithm": {"advantage": "gae"}, "trainer": {"kl_coef": 0.1}}}
    steps = {}
    for name, sections in runs.items():
        cfg = config(tmp_path / name, **sections)
        simulate(cfg)
        steps[name] = train_s(tmp_path / name)
    costs = simulation_costs(cfg)
    call, update = costs.hardware.call_s, costs.update(1)
    grpo = steps["grpo"]
    assert max(grpo) == pytest.approx(min(grpo))  # every step the same micro-batches
    policy = grpo[0] - call - update  # the policy's forward and backward
    assert policy > 0
    calls = 5 * call  # prepare, reference, values, advantages, critic update
    expected = {"kl": calls + policy / 3,
                "gae": calls + policy / 3 + policy + update,
                "ppo": calls + 2 * policy / 3 + policy + update}
    for name, more in expected.items():
        assert len(steps[name]) == len(grpo)
        for step, (seconds, base) in enumerate(zip(steps[name], grpo, strict=True)):
            assert seconds - base == pytest.approx(more, rel=1e-6), (name, step)
    # PPO's trainer computes the policy (with the reference's pass) and the critic alike.
    assert step_passes(cfg) == pytest.approx(1 + 1 / 3 + 4 / 3)


def test_a_gae_config_is_accepted_and_its_idle_table_shows_the_roles(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "ppo.toml"
    folder = model_dir(tmp_path, SMALL)
    job.write_text(f'[model]\npath = {json.dumps(str(folder))}\n[model.lora]\nrank = 8\n'
                   '[task]\nkind = "longtail"\neval_size = 0\n'
                   '[trainer]\nkl_coef = 0.05\n[algorithm]\nadvantage = "gae"\n'
                   '[critic]\nwarmup_steps = 2\n'
                   '[simulate]\nhardware = "h100"\nlengths = "lognormal"\n'
                   'length_median = 40.0\nprompt_tokens = 16\n')
    out = tmp_path / "run"
    assert main(["simulate", str(job), "--set", "run.progress=false", "--set",
                 f"run.output_dir={json.dumps(str(out))}", "--set", "run.num_steps=6"]) == 0
    printed = capsys.readouterr().out
    lines = {line.split(" idle ")[0].strip(): line for line in printed.splitlines()
             if line.strip().startswith(("trainer idle", "critic idle"))}
    assert set(lines) == {"trainer", "critic"}, printed
    assert "critic " in lines["trainer"].split(":", 1)[1]  # the device lent to the critic
    assert "policy " in lines["critic"].split(":", 1)[1]  # and back to the policy
    idle, _ = idle_of(read_spans(out))
    roles = {r.role: r for r in idle.roles}
    trainer, critic = roles["trainer"], roles["critic"]
    # What the trainer lends the critic is the critic's busy time, and the other way.
    assert trainer.idle_by_cause["critic"] == pytest.approx(critic.busy_s, rel=1e-6)
    assert critic.idle_by_cause["policy"] > 0
    rows = read_metrics(out)
    assert len(rows) == 6 and all("critic/update_s" in r for r in rows)
    adapters = adapter_parameters(str(folder), LoraConfig(rank=8))
    sent = [b["bytes"] for r in rows for b in r["broadcast"]]
    assert sent and set(sent) == {adapters * 4}  # float32 adapters, every version
    assert f"a version of {adapters * 4 / 2**20:,.1f} MiB into every engine" in printed


def test_a_full_version_carries_every_weight(tmp_path: Path) -> None:
    out = tmp_path / "run"
    simulate(config(out))
    sent = [b["bytes"] for r in read_metrics(out) for b in r["broadcast"]]
    assert sent and set(sent) == {4.0e7 * 4}


def test_roles_beside_busy_engines_slow_as_the_policy_does(tmp_path: Path) -> None:
    """On a CPU machine laid out as a real run, the critic's passes share the cores with
    the engines as the policy's do: slower than with every worker on devices of its
    own."""
    lent = {}
    for name, cores in (("alone", 0), ("shared", 2)):
        cfg = config(tmp_path / name, cores=cores, algorithm={"advantage": "gae"},
                     simulate={"hardware": "cpu"})
        simulate(cfg)
        idle, _ = idle_of(read_spans(tmp_path / name))
        (trainer,) = [r for r in idle.roles if r.role == "trainer"]
        lent[name] = trainer.idle_by_cause["critic"]
    assert lent["shared"] > 1.05 * lent["alone"] > 0


def test_time_shared_engines_free_the_devices_for_the_roles_passes_too(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    simulate(config(out, steps=6, rollout={"num_workers": 1},
                    run={"colocate": "time", "num_steps": 6},
                    algorithm={"advantage": "gae"}, trainer={"kl_coef": 0.1}))
    stats = json.loads((out / "sim.json").read_text())
    assert stats["time_shared"] and stats["releases"] == 6  # once a step, not per stage
    spans = read_spans(out)
    generating = [(s.start, s.end) for s in spans
                  if s.role == "rollout" and s.cause in BUSY["rollout"]]
    on_devices = [(s.start, s.end) for s in spans
                  if s.role in ("trainer", "critic") and s.cause in BUSY[s.role]]
    assert len(generating) > 6 and len(on_devices) > 3 * 6
    overlaps = [(g, d) for g in generating for d in on_devices
                if min(g[1], d[1]) - max(g[0], d[0]) > 1e-9]
    assert not overlaps


def test_calibration_from_a_ppo_run_fits_the_policy_s_cost_alone(tmp_path: Path) -> None:
    real = tmp_path / "real"
    simulate(config(real, steps=10, algorithm={"advantage": "gae"},
                    simulate={"lengths": "lognormal", "length_median": 30.0,
                              "length_sigma": 0.8, "hardware": "cpu"}))
    fit = calibrate(real, tmp_path / "fitted.toml", mfus=(0.1,), bisections=2)
    assert fit.hardware.train_mfu == pytest.approx(load_hardware("cpu").train_mfu, rel=0.1)


@pytest.mark.parametrize("section", ["reference", "critic"])
def test_a_role_on_workers_of_its_own_is_refused_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], section: str) -> None:
    """The simulator models the roles on the trainer shards' devices only: an "own"
    placement exits 2 rather than being simulated as "trainer"."""
    job = tmp_path / "own.toml"
    folder = model_dir(tmp_path, SMALL)
    job.write_text(f'[model]\npath = {json.dumps(str(folder))}\n'
                   '[trainer]\nkl_coef = 0.05\n[algorithm]\nadvantage = "gae"\n'
                   f'[{section}]\nplacement = "own"\n'
                   '[simulate]\nhardware = "h100"\n')
    out = tmp_path / "run"
    assert main(["simulate", str(job), "--set", "run.progress=false", "--set",
                 f"run.output_dir={json.dumps(str(out))}"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and f'{section}.placement = "own"' in errors[0], errors
