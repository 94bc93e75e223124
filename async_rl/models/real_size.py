"""A real-size model without a hub: Qwen2.5-0.5B's shape, randomly initialised.

Owns: the real-size shapes (``QWEN25_05B``), their Qwen2 config (``real_size_config``)
and ``make_random_model``, which writes one with the local byte-level tokenizer and its
chat template (``async_rl.models.tiny_model.build_tokenizer``), so that every id the
model can generate decodes. There is no warm start: the weights are random, so a run on
it measures speed and memory (``bench/trainer/real_size.py``, ``bench/trainer/gpu_check.py``), not
learning. Knows nothing about vLLM, Ray or training. Nothing is downloaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import msgspec
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from async_rl.models.tiny_model import (
    EOS_ID,
    MADE_MODEL_FILE,
    PAD_ID,
    VOCAB_SIZE,
    MadeModel,
    ModelSize,
    _torch_threads,
    build_tokenizer,
    size_config,
)

QWEN25_05B: Final = ModelSize(name="0.5b", hidden_size=896, num_layers=24, num_heads=14,
                              num_kv_heads=2, intermediate_size=4864, sft_steps=0, sft_lr=0.0)
"""Qwen2.5-0.5B's shape (head_dim 64, grouped-query attention 14/2, tied embeddings) with
the local tokenizer's 264-token vocabulary instead of 151,936: 358M parameters instead
of 494M, all of them in the decoder layers but 0.24M."""
REAL_SIZES: Final = {size.name: size for size in (QWEN25_05B,)}
MAX_POSITIONS: Final = 4096
"""Context the config declares (Qwen2.5-0.5B's is 32768): long enough for any built-in
task, short enough that vLLM's CPU build fits a whole sequence in a small KV cache."""
ROPE_THETA: Final = 1_000_000.0
"""Qwen2.5's RoPE base."""


def real_size_config(size: ModelSize = QWEN25_05B) -> Qwen2Config:
    """The Qwen2 config of a real-size shape, on the local tokenizer's vocabulary."""
    config = size_config(size, MAX_POSITIONS)
    config.rope_parameters = {"rope_type": "default", "rope_theta": ROPE_THETA}
    return config


def make_random_model(
    out_dir: str | Path,
    *,
    size: ModelSize = QWEN25_05B,
    seed: int = 0,
    num_threads: int | None = None,
    log: Callable[[str], None] | None = print,
) -> MadeModel:
    """Writes a randomly initialised ``size`` model (float32) and the local tokenizer to
    ``out_dir`` (existing files are overwritten); same seed, same weights.
    ``num_threads``: torch intra-op threads for the initialisation, restored afterwards
    (``None`` leaves them).

    Its ``MadeModel`` record says ``sft_steps = 0`` and ``eval_size = 0``: nothing was
    warm-started or measured (``base_accuracy`` 0).
    """
    start = time.perf_counter()
    out = Path(out_dir)
    with _torch_threads(num_threads):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(real_size_config(size))
    model.generation_config = GenerationConfig(
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    n_params = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    made = MadeModel(
        path=str(out), size=size.name, num_parameters=n_params, base_accuracy=0.0,
        eval_size=0, seed=seed, sft_steps=0, teacher_accuracy=0.0, max_operand=0,
        dtype=str(model.dtype).removeprefix("torch."), seconds=time.perf_counter() - start,
    )
    (out / MADE_MODEL_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(made)))
    if log is not None:
        log(f"{size.name} qwen2 (random, no warm start): {n_params / 1e6:.1f}M parameters, "
            f"vocab {VOCAB_SIZE}; saved to {out} in {made.seconds:.1f}s")
    return made
