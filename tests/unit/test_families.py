"""The model matrix's families (``async_rl.models.families``): every architecture's tiny
config builds a model that runs a forward, with the shapes and features the matrix
relies on, and a saved family model loads by path with its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl.models.families import (
    ARCHITECTURES,
    FAMILY_KEYWORDS,
    FEATURES,
    HEAD_DIM,
    NUM_EXPERTS,
    SLIDING_WINDOW,
    build_family_model,
    model_type,
    tiny_config,
)
from async_rl.models.tiny_model import EOS_ID, VOCAB_SIZE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SLIDING = ("mistral", "gemma2", "gemma3", "gpt_oss")
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
MOE = ("qwen3_moe", "mixtral", "olmoe", "granitemoe", "gpt_oss", "qwen3_next",
       "qwen3_5_moe")


def test_the_families_are_the_issue_s_list() -> None:
    assert len(ARCHITECTURES) == len(set(ARCHITECTURES)) >= 18
    assert {*SLIDING, *HYBRID, *MOE} <= set(ARCHITECTURES)
    assert list(FEATURES) == list(FAMILY_KEYWORDS) == list(ARCHITECTURES)
    with pytest.raises(ValueError, match="unknown architecture 'bert'"):
        tiny_config("bert")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_family_builds_and_runs_a_forward(arch: str) -> None:
    config = tiny_config(arch)
    assert config.model_type == model_type(arch)
    assert config.vocab_size == VOCAB_SIZE and config.eos_token_id == EOS_ID
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim == HEAD_DIM  # vLLM's CPU attention needs >= 32
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query
    layer_types = getattr(config, "layer_types", None) or []
    if arch in HYBRID:
        assert set(layer_types) == {"linear_attention", "full_attention"}
    if arch in SLIDING:
        assert config.sliding_window == SLIDING_WINDOW
    if arch in MOE:
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        assert experts == NUM_EXPERTS
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, VOCAB_SIZE, (2, 3 * SLIDING_WINDOW))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (2, 3 * SLIDING_WINDOW, VOCAB_SIZE)
    assert bool(torch.isfinite(logits).all()) and float(logits.std()) > 0


def test_the_distinctive_features_are_on() -> None:
    assert tiny_config("granite").logits_scaling != 1.0
    assert tiny_config("granitemoe").logits_scaling != 1.0
    assert tiny_config("cohere").logit_scale != 1.0
    gemma2 = tiny_config("gemma2")
    assert gemma2.final_logit_softcapping and gemma2.attn_logit_softcapping
    assert 0 in tiny_config("smollm3").no_rope_layers  # a layer without RoPE


def test_a_saved_family_model_loads_by_path_with_its_tokenizer(tmp_path: Path) -> None:
    out = build_family_model("qwen3_moe", tmp_path / "m", seed=3)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert next(model.parameters()).dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer.encode("1 + 2 = 3")) == "1 + 2 = 3"
    again = AutoModelForCausalLM.from_pretrained(build_family_model("qwen3_moe", tmp_path / "n",
                                                                    seed=3))
    for (name, got), (_, want) in zip(model.state_dict().items(),
                                      again.state_dict().items(), strict=True):
        assert torch.equal(got, want), name
