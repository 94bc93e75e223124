"""The attention kind a config.json names, as the costs see it: multi-head latent
attention's smaller KV cache, a linear-attention hybrid's full-attention layers and the
fixed state of its linear ones (Gated DeltaNet, Kimi Delta Attention), each against a
hand computation; a config.json without those keys counted as before; the state reaching
a decode step's cost and an engine's KV-cache reservations. The weights of latent and
linear attention layers and of DeepSeek's experts, by hand and against the published
totals of DeepSeek-V3 and Qwen3-Next (every parameter of the transformers classes:
``tests/unit/test_simulate_setups.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from async_rl.analysis.results import SIM_STATS, SimStats
from async_rl.api import simulate
from async_rl.config import Config
from async_rl.sim.architecture import (
    attention_state,
    full_attention_parameters,
    layer_kinds,
    linear_attention_parameters,
    mlp_parameters,
)
from async_rl.sim.costs import Costs, ModelShape, model_shape
from async_rl.sim.hardware_file import load_hardware
from async_rl.sim.run import simulation_costs
from workers.model_config import kv_bytes_per_token

QWEN25_7B: dict[str, Any] = {
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "tie_word_embeddings": False}
DEEPSEEK_V3: dict[str, Any] = {  # its config.json's attention keys
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
QWEN3_NEXT: dict[str, Any] = {  # Qwen3-Next-80B-A3B's attention keys
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128}
KIMI_LINEAR: dict[str, Any] = {  # MLA every fourth layer, Kimi Delta Attention between
    "hidden_size": 2304, "num_hidden_layers": 8, "num_attention_heads": 32,
    "num_key_value_heads": 32, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128,
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8],
                           "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}}


def test_a_config_without_the_keys_is_counted_as_before() -> None:
    got = attention_state(QWEN25_7B, 2.0)
    assert got.kv_bytes_per_token == kv_bytes_per_token(QWEN25_7B, 2.0) == 57344
    assert got.attention_width == 28 * 28 * 128 == 100352
    assert got.state_bytes_per_sequence == 0.0
    assert layer_kinds(QWEN25_7B) == (28, 0)


def test_latent_attention_caches_one_latent_and_one_rotary_key() -> None:
    got = attention_state(DEEPSEEK_V3, 2.0)
    assert got.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70272
    # Scores at 128 + 64 per head, the weighted sum at 128: (192 + 128) / 2 = 160.
    assert got.attention_width == 61 * 128 * 160
    assert got.state_bytes_per_sequence == 0.0
    # Grouped-query counting would have said 61 x 2 x 128 heads x 56 x 2 bytes: 25x more.
    assert kv_bytes_per_token(DEEPSEEK_V3, 2.0) == 61 * 2 * 128 * 56 * 2
    assert kv_bytes_per_token(DEEPSEEK_V3, 2.0) > 24 * got.kv_bytes_per_token


def test_gated_deltanet_hybrid_caches_its_full_layers_and_a_state_per_sequence() -> None:
    assert layer_kinds(QWEN3_NEXT) == (12, 36)  # layers 4, 8, ..., 48 are full attention
    got = attention_state(QWEN3_NEXT, 2.0)
    assert got.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24576
    # Per linear layer: a 128 x 128 state for each of 32 value heads, and the last 3
    # inputs of the short convolution over q, k (16 heads x 128 each) and v (32 x 128).
    per_layer = 32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3
    assert per_layer == 548864
    assert got.state_bytes_per_sequence == 36 * per_layer * 2 == 39518208
    assert got.attention_width == 12 * 16 * 256
    # The same layers listed one by one (Qwen3.5's layer_types), the state in float32.
    listed = {**QWEN3_NEXT, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12,
              "mamba_ssm_dtype": "float32"}
    del listed["full_attention_interval"]
    assert layer_kinds(listed) == (12, 36)
    fp32 = attention_state(listed, 2.0)
    assert fp32.state_bytes_per_sequence == 36 * (
        32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2)


def test_kimi_delta_attention_beside_latent_attention() -> None:
    assert layer_kinds(KIMI_LINEAR) == (2, 6)
    got = attention_state(KIMI_LINEAR, 2.0)
    assert got.kv_bytes_per_token == 2 * (512 + 64) * 2
    assert got.state_bytes_per_sequence == 6 * (32 * 128 * 128 + 3 * 32 * 128 * 3) * 2
    only_full = {**KIMI_LINEAR, "linear_attn_config": {
        **KIMI_LINEAR["linear_attn_config"], "kda_layers": None}}
    assert layer_kinds(only_full) == (2, 6)  # counted from full_attn_layers
    none = {**KIMI_LINEAR, "linear_attn_config": {"num_heads": 32}}
    assert layer_kinds(none) == (8, 0)


def test_model_shape_reads_the_kind_from_config_json(tmp_path: Path) -> None:
    config = {**QWEN3_NEXT, "vocab_size": 151936, "intermediate_size": 5120}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = model_shape(str(tmp_path), "bfloat16")
    assert shape.kv_bytes_per_token == 24576
    assert shape.state_bytes_per_sequence == 39518208
    given = model_shape(str(tmp_path), "bfloat16", state_bytes_per_sequence=1e6,
                        kv_bytes_per_token=1000)
    assert given.state_bytes_per_sequence == 1e6 and given.kv_bytes_per_token == 1000
    # Figures given without a config.json: no state unless given.
    bare = model_shape(str(tmp_path / "none"), "bfloat16", parameters=1e9,
                       kv_bytes_per_token=1000)
    assert bare.state_bytes_per_sequence == 0.0


def test_a_sequence_state_is_read_every_decode_step() -> None:
    h = load_hardware("h100")
    plain = ModelShape(parameters=1e9, kv_bytes_per_token=1e5, bytes_per_parameter=2.0)
    hybrid = msgspec.structs.replace(plain, state_bytes_per_sequence=4e7)
    a, b = Costs(h, plain), Costs(h, hybrid)
    bandwidth = h.memory_bandwidth * h.memory_efficiency
    # Memory-bound: 8 sequences' states read besides the weights and 10,000 tokens of KV.
    assert b.decode_step(8, 10000) - a.decode_step(8, 10000) == pytest.approx(
        8 * 4e7 / bandwidth)
    assert b.state_tokens == 400.0 and a.state_tokens == 0.0
    # The closed form over many steps is the sum of the steps.
    steps = [b.decode_step(8, 10000 + 8 * s) for s in range(50)]
    assert b.decode_steps(50, 8, 10000) == pytest.approx(sum(steps))


def config(out: Path, **simulate_: object) -> Config:
    return msgspec.convert({
        "model": {"path": "not-needed"},
        "task": {"kind": "longtail", "eval_size": 0},
        "rollout": {"num_workers": 1, "group_size": 4, "max_new_tokens": 128,
                    "max_inflight_prompts": 8, "memory_fraction": 0.5},
        "queue": {"max_groups": 64, "bucket_edges": [128, 512]},
        "staleness": {"max_staleness": 1},
        "trainer": {"num_shards": 1, "groups_per_step": 8, "micro_batch_tokens": 512},
        "run": {"num_steps": 3, "output_dir": str(out), "progress": False, "eval_every": 0},
        "simulate": {"parameters": 1.0e6, "kv_bytes_per_token": 4096,
                     "lengths": "lognormal", "length_median": 30.0, "length_sigma": 0.8,
                     "hardware": "h100",
                     "hardware_overrides": {"device_memory": 20e6}, **simulate_},
    }, Config)


def test_an_engine_reserves_each_sequence_state_in_its_kv_cache(tmp_path: Path) -> None:
    # 20 MB x 0.5 less the weights' bytes, in 4,096-byte tokens; a state of 100 tokens'
    # bytes a sequence leaves room for fewer sequences at once.
    costs = simulation_costs(config(tmp_path / "x", state_bytes_per_sequence=409600))
    assert costs.state_tokens == 100
    room = (10e6 - costs.weight_bytes) / 4096
    runs = {}
    for name, state in (("plain", 0.0), ("hybrid", 409600.0)):
        simulate(config(tmp_path / name, state_bytes_per_sequence=state))
        runs[name] = msgspec.json.decode((tmp_path / name / SIM_STATS).read_bytes(),
                                         type=SimStats)
    plain, hybrid = runs["plain"], runs["hybrid"]
    assert plain.kv_limit_tokens == hybrid.kv_limit_tokens == pytest.approx(room)
    assert hybrid.requests > 0 and plain.requests > 0
    assert hybrid.kv_queued > 5 * plain.kv_queued
    assert hybrid.kv_wait_s > 5 * plain.kv_wait_s


DEEPSEEK_V3_FULL: dict[str, Any] = {  # DeepSeek-V3's config.json, as the counts read it
    **DEEPSEEK_V3, "model_type": "deepseek_v3", "vocab_size": 129280,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "tie_word_embeddings": False}
QWEN3_NEXT_FULL: dict[str, Any] = {  # Qwen3-Next-80B-A3B's config.json
    **QWEN3_NEXT, "model_type": "qwen3_next", "vocab_size": 151936,
    "intermediate_size": 5120, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}


def test_latent_attention_weights_by_hand() -> None:
    # q_a 7168·1536, its norm 1536, q_b 1536·128·(128 + 64); kv_a 7168·(512 + 64), its
    # norm 512, kv_b 512·128·(128 + 128); o 128·128·7168.
    assert full_attention_parameters(DEEPSEEK_V3) == (
        7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256
        + 128 * 128 * 7168) == 187_107_328
    # Without a query latent (DeepSeek-V2-Lite, Kimi's latent layers): q 7168·128·192.
    no_latent = {**DEEPSEEK_V3, "q_lora_rank": None}
    assert full_attention_parameters(no_latent) == (
        7168 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168)


def test_linear_attention_weights_by_hand() -> None:
    # Gated DeltaNet: keys 16·128 = 2048, values 32·128 = 4096; in_proj_qkvz
    # 2048·(2·2048 + 2·4096), in_proj_ba 2048·2·32, the convolution (2·2048 + 4096)·4,
    # a decay and its bias per value head 2·32, the gated norm 128, out 4096·2048.
    assert linear_attention_parameters(QWEN3_NEXT) == (
        2048 * 12288 + 2048 * 64 + 8192 * 4 + 64 + 128 + 4096 * 2048) == 33_718_464
    # Kimi Delta Attention: width 32·128 = 4096; q, k, v 3·2304·4096 and their
    # convolutions 3·4096·4; forget and output gates 2·(2304·128 + 128·4096); the decay's
    # bias 4096, the decay 32, beta 2304·32; the gated norm 128; out 4096·2304.
    assert linear_attention_parameters(KIMI_LINEAR) == (
        3 * 2304 * 4096 + 3 * 4096 * 4 + 2 * (2304 * 128 + 128 * 4096) + 4096 + 32
        + 2304 * 32 + 128 + 4096 * 2304)
    assert linear_attention_parameters(DEEPSEEK_V3) == 0  # none named


def test_deepseek_experts_by_hand() -> None:
    # 3 dense layers of 3·7168·18432; 58 MoE layers of a router 7168·256, 256 routed
    # experts and 1 shared expert of 3·7168·2048 each, 8 routed and the shared per token.
    dense, expert = 3 * 7168 * 18432, 3 * 7168 * 2048
    fixed = 3 * dense + 58 * (7168 * 256 + expert)
    assert mlp_parameters(DEEPSEEK_V3_FULL) == (fixed + 58 * 256 * expert,
                                                fixed + 58 * 8 * expert)


@pytest.mark.parametrize(("config", "total", "active"), [
    (DEEPSEEK_V3_FULL, 671e9, 37e9),  # without its multi-token prediction module
    (QWEN3_NEXT_FULL, 80e9, 3e9),
])
def test_published_totals_are_counted_from_config_json(
        config: dict[str, Any], total: float, active: float, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = model_shape(str(tmp_path), "bfloat16")
    print(f"{config['model_type']}: {shape.parameters / 1e9:.2f}B, "
          f"{shape.active_parameters / 1e9:.2f}B active")
    assert shape.parameters == pytest.approx(total, rel=0.005)
    # Published active counts are rounded down (to 37B and 3B) and may leave out the
    # embeddings (Qwen3-Next: 0.62B of them).
    assert active <= shape.active_parameters <= active * 1.3
