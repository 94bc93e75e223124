"""The KV cache a CPU engine is given: 1 GiB for a model whose worst case fits in it;
the cache salt a prompt carries (raw_prompt)."""

from __future__ import annotations

import json
from pathlib import Path

from workers.model_config import ModelConfig, kv_bytes_per_token
from workers.rollout.config import RolloutConfig
from workers.rollout.engine import cpu_kv_cache_gib, raw_prompt

SMALL = {"num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 128,
         "num_hidden_layers": 4, "max_position_embeddings": 128}
QWEN_05B = {"num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896,
            "num_hidden_layers": 24, "max_position_embeddings": 32768}


def model_dir(tmp_path: Path, hf_config: dict[str, int]) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    return ModelConfig(path=str(tmp_path))


def test_kv_bytes_count_keys_and_values_of_every_layer() -> None:
    assert kv_bytes_per_token(SMALL, 4) == 2 * 4 * 4 * 32 * 4
    assert kv_bytes_per_token(QWEN_05B, 2) == 2 * 24 * 2 * 64 * 2
    assert kv_bytes_per_token({**QWEN_05B, "head_dim": 128}, 2) == 2 * 24 * 2 * 128 * 2


def test_a_small_model_gets_one_gib(tmp_path: Path) -> None:
    assert cpu_kv_cache_gib(RolloutConfig(), model_dir(tmp_path, SMALL)) == 1


def test_a_real_model_is_left_to_vllm(tmp_path: Path) -> None:
    assert cpu_kv_cache_gib(RolloutConfig(), model_dir(tmp_path, QWEN_05B)) == 0


def test_the_configured_size_wins(tmp_path: Path) -> None:
    model = model_dir(tmp_path, SMALL)
    assert cpu_kv_cache_gib(RolloutConfig(kv_cache_gib=3), model) == 3


def test_no_context_length_or_no_config_is_left_to_vllm(tmp_path: Path) -> None:
    no_context = {k: v for k, v in SMALL.items() if k != "max_position_embeddings"}
    assert cpu_kv_cache_gib(RolloutConfig(), model_dir(tmp_path, no_context)) == 0
    assert cpu_kv_cache_gib(RolloutConfig(), ModelConfig(path=str(tmp_path / "none"))) == 0


def test_a_salted_prompt_carries_its_salt_and_an_unsalted_one_none() -> None:
    assert raw_prompt("1+2=") == {"prompt": "1+2="}
    assert raw_prompt([5, 6], "v3") == {"prompt_token_ids": [5, 6], "cache_salt": "v3"}
    assert raw_prompt([], "") == {"prompt_token_ids": []}
