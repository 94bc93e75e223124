"""The tiny model and its tokenizer: round trips, loading the way vLLM does
(``AutoTokenizer`` on a qwen2 directory), a shape vLLM's CPU attention accepts, and the
made-model record. Builds with a handful of warm-start steps so it stays fast; no engine.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from async_rl.models.tiny_model import (
    BYTE_OFFSET,
    CALCULATOR,
    EOS_ID,
    LONGTAIL,
    MADE_MODEL_FILE,
    MODEL_SIZES,
    PAD_ID,
    SMALL,
    TASK_RECIPES,
    TINY,
    UNK_ID,
    VOCAB_SIZE,
    MadeModel,
    build_config,
    build_tokenizer,
    make_model,
)
from async_rl.tasks.calculator import MAX_TURNS, TURN_MAX_NEW_TOKENS, CalculatorTask
from async_rl.tasks.longtail import MAX_DIVISOR, MAX_NEW_TOKENS, MAX_NUMBER, RemainderTask
from async_rl.tasks.rewards import arithmetic_reward
from async_rl.tasks.sources import ArithmeticTask
from workers.eval.greedy import evaluate_accuracy, greedy_completions

TEXTS = [
    "12+7=",
    "Hi there,  12+7=19\n\tx!",
    "  leading and trailing  ",
    "a\n\nb\r\n",
    "#### 1,234 (é, ☃, 🙂)",
    "~`!@#$%^&*()_-+={}[]|\\:;\"'<>,.?/",
]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> MadeModel:
    out = tmp_path_factory.mktemp("tiny")
    return make_model(out, seed=0, sft_steps=3, eval_size=16, log=None)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_text(text: str) -> None:
    tok = build_tokenizer()
    ids = tok.encode(text)
    assert ids == [BYTE_OFFSET + b for b in text.encode()]  # one token per byte, no BOS
    assert tok.decode(ids) == text
    assert tok.decode([*ids, EOS_ID], skip_special_tokens=True) == text


def test_tokenizer_special_tokens() -> None:
    tok = build_tokenizer()
    assert len(tok) == VOCAB_SIZE and VOCAB_SIZE % 8 == 0
    assert (tok.pad_token_id, tok.eos_token_id) == (PAD_ID, EOS_ID)
    assert tok.bos_token_id is None
    assert tok.unk_token_id is not None
    assert tok("3+4=").input_ids == tok.encode("3+4=") == [BYTE_OFFSET + b for b in b"3+4="]


def test_saved_tokenizer_loads_identically_through_auto_tokenizer(made: MadeModel) -> None:
    # AutoTokenizer (and vLLM with it) rebuilds a qwen2 directory's tokenizer through
    # Qwen2Tokenizer; it must still encode exactly like the tokenizer.json we wrote.
    auto = AutoTokenizer.from_pretrained(made.path)
    plain = PreTrainedTokenizerFast(tokenizer_file=str(Path(made.path) / "tokenizer.json"))
    assert (auto.eos_token_id, auto.pad_token_id, auto.bos_token_id) == (EOS_ID, PAD_ID, None)
    for text in TEXTS:
        ids = build_tokenizer().encode(text)
        assert auto.encode(text) == plain.encode(text) == ids
        assert auto.decode(ids) == text


def test_made_model_loads_with_a_vllm_cpu_friendly_shape(made: MadeModel) -> None:
    model = AutoModelForCausalLM.from_pretrained(made.path)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    assert head_dim >= 32
    assert config.model_type == "qwen2"
    assert config.tie_word_embeddings
    assert (config.eos_token_id, config.pad_token_id, config.vocab_size) == (
        EOS_ID,
        PAD_ID,
        VOCAB_SIZE,
    )
    assert model.generation_config.eos_token_id == EOS_ID
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == made.num_parameters
    assert 0.0 <= made.base_accuracy <= 1.0
    assert made.sft_steps == 3 and made.eval_size == 16 and made.dtype == "float32"
    record = msgspec.json.decode((Path(made.path) / MADE_MODEL_FILE).read_bytes(), type=MadeModel)
    assert record == made


def test_make_model_is_deterministic_per_seed(made: MadeModel, tmp_path: Path) -> None:
    again = make_model(tmp_path, seed=0, sft_steps=3, eval_size=16, log=None)
    first = AutoModelForCausalLM.from_pretrained(made.path).state_dict()
    second = AutoModelForCausalLM.from_pretrained(again.path).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert again.base_accuracy == made.base_accuracy


def test_sizes_build_the_shape_they_name(made: MadeModel, tmp_path: Path) -> None:
    assert MODEL_SIZES == {"tiny": TINY, "small": SMALL}
    small = make_model(tmp_path, size=SMALL, sft_steps=1, eval_size=4, log=None)
    assert (made.size, small.size, small.sft_steps) == ("tiny", "small", 1)
    config = AutoModelForCausalLM.from_pretrained(small.path).config
    assert (config.hidden_size, config.num_hidden_layers) == (SMALL.hidden_size,
                                                              SMALL.num_layers)
    # The CPU default relies on SMALL being several times the work of TINY per token.
    assert small.num_parameters > 6 * made.num_parameters


def test_greedy_evaluation(made: MadeModel) -> None:
    model = AutoModelForCausalLM.from_pretrained(made.path)
    tok = AutoTokenizer.from_pretrained(made.path)
    prompts = ArithmeticTask().eval_prompts(16)
    texts = greedy_completions(model, tok, [p.text for p in prompts], max_new_tokens=3)
    assert len(texts) == 16 and all(isinstance(t, str) for t in texts)
    assert evaluate_accuracy(model, tok, prompts, lambda p, t: 1.0) == 1.0
    expected = sum(arithmetic_reward(p, t) for p, t in zip(prompts, texts, strict=True)) / 16
    assert evaluate_accuracy(model, tok, prompts, arithmetic_reward, max_new_tokens=3) == expected
    with pytest.raises(ValueError, match="at least one"):
        evaluate_accuracy(model, tok, [], arithmetic_reward)


def test_greedy_batches_by_length_match_one_at_a_time(made: MadeModel) -> None:
    model = AutoModelForCausalLM.from_pretrained(made.path)
    tok = AutoTokenizer.from_pretrained(made.path)
    texts = ["3+4=", "12+17=", "9-2=", "29-11=", "0+0="]
    batched = greedy_completions(model, tok, texts, max_new_tokens=4)
    alone = [greedy_completions(model, tok, [t], max_new_tokens=4)[0] for t in texts]
    assert batched == alone


def test_build_config_rejects_small_heads() -> None:
    with pytest.raises(ValueError, match=">= 32"):
        build_config(hidden_size=64, num_heads=4)
    assert build_config().hidden_size // build_config().num_attention_heads >= 32


@torch.no_grad()
def greedy_without_cache(model: torch.nn.Module, tok: PreTrainedTokenizerFast, text: str,
                         max_new_tokens: int) -> str:
    """The reference ``greedy_completions`` must match: the whole sequence re-run per token."""
    ids = tok.encode(text)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids + out]), use_cache=False).logits
        nxt = int(logits[0, -1].argmax())
        if nxt == EOS_ID:
            return str(tok.decode(out))
        out.append(nxt)
    return str(tok.decode([*out, UNK_ID]))


def test_longtail_model_fits_its_traces_and_cached_greedy_matches(
    tmp_path: Path, one_torch_thread: None
) -> None:
    assert TASK_RECIPES["longtail"] is LONGTAIL
    made = make_model(tmp_path, task=LONGTAIL, size=TINY, sft_steps=2, eval_size=4, log=None)
    assert (made.task, made.size, made.sft_steps, made.eval_size) == ("longtail", "tiny", 2, 4)
    assert 0.0 <= made.base_accuracy <= 1.0
    record = msgspec.json.decode((Path(made.path) / MADE_MODEL_FILE).read_bytes(), type=MadeModel)
    assert record == made
    model = AutoModelForCausalLM.from_pretrained(made.path)
    longest_prompt = len(f"{MAX_NUMBER}%{MAX_DIVISOR}=")
    assert max(len(p.text) for p in RemainderTask().eval_prompts(200)) <= longest_prompt
    assert model.config.max_position_embeddings >= MAX_NEW_TOKENS + longest_prompt
    assert LONGTAIL.eval_max_new_tokens == MAX_NEW_TOKENS
    # Two warm-start steps leave a model that writes spaces whatever the context, which
    # would hide a cache bug: jitter the weights so each token depends on all before it.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    # Prompts of two lengths (two decoding batches); a few tokens each.
    tok = AutoTokenizer.from_pretrained(made.path)
    assert tok.model_max_length >= model.config.max_position_embeddings
    texts = ["47%9=", "99%19=", "12%5="]
    cached = greedy_completions(model, tok, texts, max_new_tokens=8)
    assert cached == [greedy_without_cache(model, tok, t, 8) for t in texts]
    assert len(set(cached)) == len(texts) and all(len(set(c)) > 2 for c in cached), cached


def test_calculator_model_is_measured_with_the_tool_and_fits_its_trajectories(
    tmp_path: Path, one_torch_thread: None
) -> None:
    assert TASK_RECIPES["calculator"] is CALCULATOR
    made = make_model(tmp_path, task=CALCULATOR, size=TINY, sft_steps=2, eval_size=4, log=None)
    assert (made.task, made.size, made.sft_steps, made.eval_size) == ("calculator", "tiny", 2, 4)
    assert made.base_accuracy == 0.0  # two steps cannot call a tool, let alone answer
    model = AutoModelForCausalLM.from_pretrained(made.path)
    longest = max(len(p.text) for p in CalculatorTask().eval_prompts(500))
    assert model.config.max_position_embeddings >= longest + MAX_TURNS * (
        TURN_MAX_NEW_TOKENS + len("<result>-999999</result>"))
