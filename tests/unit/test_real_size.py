"""The real-size model: Qwen2.5-0.5B's shape on the local tokenizer, randomly initialised."""

from __future__ import annotations

from pathlib import Path

import msgspec
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl.models.real_size import QWEN25_05B, REAL_SIZES, make_random_model, real_size_config
from async_rl.models.tiny_model import MADE_MODEL_FILE, VOCAB_SIZE, MadeModel


def test_the_config_has_qwen25_05b_shape_and_the_tokenizer_vocabulary() -> None:
    config = real_size_config()
    assert REAL_SIZES == {"0.5b": QWEN25_05B}
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size) == (896, 24, 14, 2, 4864)
    assert config.tie_word_embeddings and config.vocab_size == VOCAB_SIZE
    assert config.rope_parameters["rope_theta"] == 1e6


def test_a_random_model_saves_weights_tokenizer_and_record(tmp_path: Path) -> None:
    # The full shape takes about 15 s; a two-layer cut of it checks the same writer.
    small = msgspec.structs.replace(QWEN25_05B, num_layers=2, intermediate_size=256)
    made = make_random_model(tmp_path, size=small, seed=3, log=None)
    record = msgspec.json.decode((tmp_path / MADE_MODEL_FILE).read_bytes(), type=MadeModel)
    assert record == made and (made.sft_steps, made.eval_size, made.seed) == (0, 0, 3)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert sum(p.numel() for p in model.parameters()) == made.num_parameters
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.chat_template and len(tokenizer) == VOCAB_SIZE
    # Every id the model can sample decodes (the vocabulary is the tokenizer's).
    assert model.config.vocab_size == len(tokenizer)
    again = make_random_model(tmp_path / "again", size=small, seed=3, log=None)
    assert again.num_parameters == made.num_parameters
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert all(a.equal(b) for a, b in zip(model.parameters(), first.parameters(), strict=True))
