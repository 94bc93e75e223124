"""Setups the simulator must express: every hardware key from --set, mixture-of-experts
models (active < total parameters), a KV-cache bound per engine, time-shared devices
(run.colocate = "time") and uneven group counts per trainer shard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from async_rl.analysis.results import SIM_STATS, SimStats
from async_rl.api import simulate, train
from async_rl.config import Config, HardwareOverrides
from async_rl.config_io import load_config
from async_rl.run.run_dir import read_metrics
from async_rl.sim.costs import Costs, ModelShape, model_shape
from async_rl.sim.hardware_file import Hardware, load_hardware
from async_rl.sim.run import simulation_costs
from buffers.common.config import ConfigError
from workers.common.spans import Span

NOT_COSTS = {"name", "sources"}
"""Hardware fields that label a file rather than cost anything."""


def config(out: Path, *, workers: int = 1, shards: int = 1, groups: int = 8,
           steps: int = 6, colocate: object = False, memory_fraction: float = 0.2,
           hardware_overrides: dict[str, float] | None = None, **simulate_: object) -> Config:
    """A tiny model on h100s; keys of the hardware file among ``simulate_`` go to
    simulate.hardware_overrides."""
    overrides = {**(hardware_overrides or {}),
                 **{k: v for k, v in simulate_.items() if k in Hardware.__struct_fields__}}
    simulate_ = {k: v for k, v in simulate_.items() if k not in overrides}
    return msgspec.convert({
        "model": {"path": "not-needed"},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"num_workers": workers, "group_size": 4, "max_new_tokens": 128,
                    "max_inflight_prompts": 8, "memory_fraction": memory_fraction},
        "queue": {"max_groups": 64, "bucket_edges": [128, 512]},
        "staleness": {"max_staleness": 0},
        "trainer": {"num_shards": shards, "groups_per_step": groups,
                    "micro_batch_tokens": 512},
        "run": {"num_steps": steps, "output_dir": str(out), "progress": False,
                "eval_every": 0, "colocate": colocate},
        "simulate": {"parameters": 4.0e6, "kv_bytes_per_token": 4096,
                     "lengths": "lognormal", "length_median": 30.0, "length_sigma": 0.8,
                     "hardware": "h100", "hardware_overrides": overrides, **simulate_},
    }, Config)


def stats(out: Path) -> SimStats:
    return msgspec.json.decode((Path(str(out)) / SIM_STATS).read_bytes(), type=SimStats)


def test_set_reaches_every_hardware_key(tmp_path: Path) -> None:
    keys = [f for f in Hardware.__struct_fields__ if f not in NOT_COSTS]
    assert set(HardwareOverrides.__struct_fields__) == set(keys)
    base = load_hardware("h100")
    overrides = []
    for i, key in enumerate(keys):
        value = getattr(base, key)
        value = 0.0 if value is None else value  # not given: derived (engine_reload_s)
        new = (value + i + 1 if isinstance(value, int)
               else round(min(value * 0.5, 1.0) + 0.001 * i, 6))
        overrides.append(f"simulate.hardware_overrides.{key}={new}")
    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "x"\n[simulate]\nhardware = "h100"\n')
    cfg = load_config(path, overrides)
    hardware = simulation_costs(msgspec.structs.replace(cfg, simulate=msgspec.structs.replace(
        cfg.simulate, parameters=7e9, kv_bytes_per_token=57344))).hardware
    assert len(overrides) == len(keys) > 15
    for item in overrides:
        key, _, text = item.removeprefix("simulate.hardware_overrides.").partition("=")
        assert getattr(hardware, key) == pytest.approx(float(text)), key
        assert getattr(hardware, key) != getattr(base, key), key
    assert hardware.name == base.name  # what was not set is the file's


def test_a_bad_or_unknown_hardware_override_is_one_line_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "x"\n')
    with pytest.raises(ConfigError, match=r"simulate\.hardware_overrides\.train_mfu = 2"):
        load_config(path, ["simulate.hardware_overrides.train_mfu=2"])
    with pytest.raises(ConfigError, match=r"simulate\.hardware_overrides\.warp_drive .*unknown"):
        load_config(path, ["simulate.hardware_overrides.warp_drive=1"])


def test_a_model_with_fewer_active_parameters_trains_at_their_cost_and_sends_all() -> None:
    hardware = load_hardware("h100")
    shape = {"kv_bytes_per_token": 57344.0, "bytes_per_parameter": 2.0}
    moe = Costs(hardware, ModelShape(parameters=30e9, active_parameters=3e9, **shape))
    dense_active = Costs(hardware, ModelShape(parameters=3e9, **shape))
    dense_total = Costs(hardware, ModelShape(parameters=30e9, **shape))
    lengths = [1000, 3000, 500]
    assert moe.micro_batch(lengths) == pytest.approx(dense_active.micro_batch(lengths))
    assert moe.micro_batch(lengths) < dense_total.micro_batch(lengths) / 5
    assert moe.prefill(4096) == pytest.approx(dense_active.prefill(4096))
    # Compute-bound decode (many sequences, no context): the active FLOPs.
    assert moe.decode_step(4096, 0) == pytest.approx(dense_active.decode_step(4096, 0))
    # Memory-bound decode (one sequence): every weight is read.
    assert moe.decode_step(1, 0) == pytest.approx(dense_total.decode_step(1, 0))
    assert moe.weight_bytes == dense_total.weight_bytes == 60e9
    assert moe.transfer(1) == pytest.approx(dense_total.transfer(1))
    assert moe.publish() == pytest.approx(dense_total.publish())
    assert moe.update(4) == pytest.approx(dense_total.update(4))  # every gradient


def test_active_parameters_reach_the_simulation_and_are_checked(tmp_path: Path) -> None:
    cfg = config(tmp_path, active_parameters=1.0e6)
    costs = simulation_costs(cfg)
    assert costs.model.active_parameters == 1.0e6 and costs.model.parameters == 4.0e6
    with pytest.raises(ConfigError, match=r"simulate\.active_parameters"):
        simulation_costs(config(tmp_path, active_parameters=5.0e6))


QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 256,
             "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 32, "vocab_size": 264, "tie_word_embeddings": False,
             "attention_bias": False, "mlp_only_layers": [], "decoder_sparse_step": 1}
"""A tiny Qwen3-MoE's config.json: 4 experts of width 64, 2 routed to per token."""


def test_a_mixture_of_experts_config_gives_its_total_and_active_parameters(
        tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
    shape = model_shape(str(tmp_path), "float32")
    # Per layer: attention 128·32·(2·4 + 2·2) = 49152 with Qwen3's query and key norms
    # 2·32, and two norms 256; the router 128·4 = 512 and 4 experts of 3·128·64 = 24576
    # each, 2 of them per token. Untied embeddings 2·264·128 = 67584, final norm 128.
    rest = 2 * (49152 + 64 + 256) + 67584 + 128
    assert shape.parameters == rest + 2 * (512 + 4 * 24576) == 364288
    assert shape.active_parameters == rest + 2 * (512 + 2 * 24576) == 265984
    # Qwen's sparse step: layer 0 (step 2) is a dense MLP of 3·128·256 = 98304.
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_MOE, "decoder_sparse_step": 2}))
    stepped = model_shape(str(tmp_path), "float32")
    assert stepped.parameters == rest + 98304 + 512 + 4 * 24576
    assert stepped.active_parameters == rest + 98304 + 512 + 2 * 24576
    # Given figures win; with simulate.parameters given, all of them are active.
    given = model_shape(str(tmp_path), "float32", active_parameters=1e5)
    assert (given.parameters, given.active_parameters) == (stepped.parameters, 1e5)
    assert model_shape(str(tmp_path), "float32", parameters=1e6).active_parameters == 0.0
    # What `async-rl simulate` costs a run of that model with: FLOPs of the active ones.
    cfg = config(tmp_path / "run")
    cfg = msgspec.structs.replace(
        cfg, model=msgspec.structs.replace(cfg.model, path=str(tmp_path)),
        simulate=msgspec.structs.replace(cfg.simulate, parameters=0.0, kv_bytes_per_token=0))
    costs = simulation_costs(cfg)
    assert costs.weight_bytes == 4 * stepped.parameters
    assert costs.micro_batch([100]) < Costs(costs.hardware, msgspec.structs.replace(
        stepped, active_parameters=0.0)).micro_batch([100])


def test_a_shared_expert_counts_in_both_and_a_dense_model_has_no_active_count(
        tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {**QWEN3_MOE, "model_type": "qwen3_next", "shared_expert_intermediate_size": 64}))
    shared = model_shape(str(tmp_path), "float32")
    # The shared expert (3·128·64) and its gate (128 -> 1), in every MoE layer; Qwen3-Next
    # gates attention's output on a query projection twice as wide (4·32·128 more).
    assert shared.parameters == 364288 + 2 * (24576 + 128 + 16384)
    assert shared.active_parameters == 265984 + 2 * (24576 + 128 + 16384)
    dense = {k: v for k, v in QWEN3_MOE.items() if "expert" not in k} | {"model_type": "qwen3"}
    (tmp_path / "config.json").write_text(json.dumps(dense))
    shape = model_shape(str(tmp_path), "float32")
    assert shape.parameters == 2 * (49152 + 64 + 256 + 3 * 128 * 256) + 67584 + 128
    assert shape.active_parameters == 0.0  # all of them: Costs counts parameters


LATENT = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
          "v_head_dim": 16, "moe_intermediate_size": 64, "first_k_dense_replace": 1}
"""Latent attention's keys and DeepSeek-style experts of a tiny config (4 layers)."""
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"moe_intermediate_size": 64, "num_experts": 4},
    "mixtral": {"num_local_experts": 4},
    "olmoe": {"num_experts": 4},
    # Gated DeltaNet every other layer, gated full attention between, a shared expert.
    "qwen3_next": {"num_experts": 4, "moe_intermediate_size": 64, "head_dim": 32,
                   "shared_expert_intermediate_size": 64, "full_attention_interval": 2,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    # Latent attention with a query latent, a shared expert, the first layer dense.
    "deepseek_v3": {**LATENT, "n_routed_experts": 4, "n_shared_experts": 1,
                    "q_lora_rank": 48, "n_group": 1, "topk_group": 1},
    # Kimi Delta Attention in three layers of four, latent attention (no query latent)
    # in the fourth; Kimi's own names for the experts' keys.
    "kimi_linear": {**LATENT, "num_experts": 4, "num_experts_per_token": 2,
                    "num_shared_experts": 1, "q_lora_rank": None, "num_key_value_heads": 4,
                    "pad_token_id": 0, "linear_attn_config": {
                        "kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 4,
                        "head_dim": 16, "short_conv_kernel_size": 4}},
}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_moe_models_counts_are_those_of_its_transformers_class(
        model_type: str, tmp_path: Path) -> None:
    """Every parameter of the real classes, counted from the config.json each saves:
    grouped-query, gated, latent and linear attention, and experts of each kind."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(
        model_type, **{"vocab_size": 264, "hidden_size": 128, "intermediate_size": 96,
                       "num_hidden_layers": 4, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "num_experts_per_tok": 2,
                       "tie_word_embeddings": False, **FAMILIES[model_type]})
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    hf_config.save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path), "float32")
    assert shape.parameters == model.num_parameters()
    assert 0 < shape.active_parameters < 0.8 * shape.parameters  # 2 of 4 experts a token


def test_the_kv_bound_holds_each_engine_under_its_limit_and_says_how_often(
        tmp_path: Path) -> None:
    # 80 GB x 0.5 less the weights (16 MB: float32) over 4096 bytes a token: big ...
    free = config(tmp_path / "free", device_memory=80e9, memory_fraction=0.5)
    assert simulation_costs(free).weight_bytes == 16e6
    simulate(free)
    roomy = stats(tmp_path / "free")
    assert roomy.kv_limit_tokens == pytest.approx((40e9 - 16e6) / 4096)
    assert roomy.kv_queued == 0 and roomy.requests >= 6 * 8
    # ... and one that holds a fraction of what runs at once (every request fits alone:
    # at most 4 x 128 tokens and a prompt): 5 MB over 4 KB = 1,220 tokens.
    tight = config(tmp_path / "tight", device_memory=21e6, memory_fraction=1.0)
    simulate(tight)
    bound = stats(tmp_path / "tight")
    assert bound.kv_limit_tokens == pytest.approx(5e6 / 4096)
    assert roomy.peak_kv_tokens > bound.kv_limit_tokens  # unbounded, more would run
    assert 0 < bound.peak_kv_tokens <= bound.kv_limit_tokens
    assert bound.kv_queued > 0 and bound.kv_wait_s > 0
    assert bound.requests == roomy.requests
    with pytest.raises(ConfigError, match=r"rollout\.memory_fraction"):
        simulate(config(tmp_path / "none", device_memory=18e6,
                        memory_fraction=0.5))


def test_time_shared_devices_move_no_weight_bytes_over_the_interconnect(
        tmp_path: Path) -> None:
    def run(name: str, bandwidth: float) -> tuple[float, list[dict[str, object]]]:
        out = tmp_path / name
        summary = simulate(config(out, colocate="time", engine_release_s=0.5,
                                  engine_reload_s=1.0,
                                  hardware_overrides={"interconnect_bandwidth": bandwidth}))
        return summary.wall_s, read_metrics(out)

    fast, rows = run("fast", 50e9)
    slow, _ = run("slow", 50e3)  # a link a million times slower changes nothing
    assert fast == pytest.approx(slow)
    timings = [t for row in rows for t in row["broadcast"]]
    assert len(timings) == 5  # the last version is delivered after the last row
    assert all(t["transfer_s"] == 0.0 for t in timings)
    shared = stats(tmp_path / "fast")
    assert shared.time_shared and shared.releases == 6
    # The same run on separate devices sends every version over that slow link.
    apart = simulate(config(tmp_path / "apart", hardware_overrides={
        "interconnect_bandwidth": 50e3}))
    assert apart.wall_s > 10 * slow


def test_time_shared_engines_never_generate_while_the_trainer_computes(
        tmp_path: Path) -> None:
    from async_rl.analysis.report import read_spans

    cfg = config(tmp_path, workers=2, shards=2, colocate="time", engine_release_s=0.2,
                 engine_reload_s=0.3, steps=4)
    simulate(cfg)
    spans = read_spans(tmp_path)
    computing = [s for s in spans if s.cause in ("forward", "backward", "optimizer")]
    generating = [s for s in spans if s.cause == "generate"]
    assert computing and generating

    def overlap(a: Span, b: Span) -> float:
        return min(a.end, b.end) - max(a.start, b.start)

    assert all(overlap(g, c) <= 1e-9 for g in generating for c in computing)
    assert stats(tmp_path).releases == 2 * 4


def test_time_shared_roles_must_span_the_same_devices_and_train_refuses_it(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r'run\.colocate = "time"'):
        simulate(config(tmp_path / "a", workers=2, shards=1, colocate="time"))
    simulate(config(tmp_path / "b", workers=2, shards=1, colocate="time",
                    hardware_overrides={"devices_per_trainer_shard": 2}))
    with pytest.raises(ConfigError, match="only async-rl simulate"):
        train(config(tmp_path / "c", colocate="time"))
    # The turns need no transport between the roles: any weights.transport states it.
    nccl = config(tmp_path / "d", colocate="time")
    assert load_config(_written(tmp_path, nccl), ["weights.transport=nccl"]).run.colocate == "time"


def _written(tmp_path: Path, cfg: Config) -> Path:
    from async_rl.config_io import to_toml

    path = tmp_path / "written.toml"
    path.write_text(to_toml(cfg))
    return path


def test_uneven_groups_per_shard_are_planned_and_trained(tmp_path: Path) -> None:
    summary = simulate(config(tmp_path, shards=3, groups=5, steps=4))
    assert summary.steps == 4 and summary.groups_trained == 4 * 5
    rows = read_metrics(tmp_path)
    assert len(rows) == 4
    for row in rows:
        assert row["groups"] == 5
        assert len(row["shards"]) == 3
        assert all(shard["tokens"] > 0 for shard in row["shards"])


def test_the_held_out_setups_are_stated_as_published(tmp_path: Path) -> None:
    from script_modules import load_script

    bench = load_script("bench/simulator/sim_published_unseen.py", "sim_published_unseen")
    assert len(bench.COMPARISONS) >= 4
    assert len({on.model.name for on, _ in bench.COMPARISONS}) == len(bench.COMPARISONS)
    for on, off in bench.COMPARISONS:
        for run in (on, off):
            cfg = run.config(tmp_path / "run", 4)
            hardware = simulation_costs(cfg).hardware
            generating = cfg.rollout.num_workers * hardware.devices_per_rollout_worker
            training = cfg.trainer.num_shards * hardware.devices_per_trainer_shard
            # On-policy: both roles on every GPU, in turns; 1-step off: half each.
            assert generating == training == (run.gpus // 2 if run.off_policy else run.gpus)
            assert cfg.run.colocate == (False if run.off_policy else "time")
            assert cfg.staleness.max_staleness == int(run.off_policy)
            assert cfg.trainer.groups_per_step * run.samples // cfg.trainer.mini_batches == 512
    on, off = bench.COMPARISONS[0]
    assert bench.step_seconds(on, 3) > 0 and bench.step_seconds(off, 3) > 0


def test_the_second_systems_setups_are_stated_as_published(tmp_path: Path) -> None:
    """verl's one-step-off table: 16 H20s, colocate sync on all of them against 4 GPUs
    generating and 12 training; 512 prompts, 16 updates a step."""
    from script_modules import load_script

    bench = load_script("bench/simulator/sim_published_unseen.py", "sim_published_unseen")
    assert len(bench.SYSTEMS) >= 2
    assert sum(len(pairs) for pairs in bench.SYSTEMS.values()) >= 4
    assert len(bench.VERL_ONE_STEP_OFF) == 2
    for on, off in bench.VERL_ONE_STEP_OFF:
        for run in (on, off):
            cfg = run.config(tmp_path / "run", 4)
            hardware = simulation_costs(cfg).hardware
            generating = cfg.rollout.num_workers * hardware.devices_per_rollout_worker
            training = cfg.trainer.num_shards * hardware.devices_per_trainer_shard
            assert (generating, training) == ((4, 12) if run.off_policy else (16, 16))
            assert hardware.name == "H20" and hardware.device_memory == 96e9
            assert cfg.trainer.groups_per_step == 512 and cfg.trainer.mini_batches == 16
            assert cfg.weights.update_mode == "drain"
        assert (on.samples, off.samples) == (16, 12)
        assert on.name != off.name
