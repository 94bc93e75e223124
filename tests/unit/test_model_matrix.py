"""The model matrix, trainer rows: every family of ``async_rl.models.families`` trains
exactly on the packed path, or is refused at start.

For each architecture, on its tiny random fp32 model and one micro-batch of four
sequences of unequal lengths (one completion of a single token, one sequence longer
than the families' sliding window three times over):

- exact: the packed path (``pack`` + ``packed_forward`` after ``use_packed_attention``,
  as a trainer shard runs it) gives the log-probs and entropies of the model's own padded
  eager forward (``attn_implementation="eager"``, right padding with an attention mask,
  the log-softmax of its own logits) to 1e-5 absolute, and every parameter's gradient
  of a randomly weighted sum of the log-probs to 1e-5 relative; the same with LoRA at
  rank 8 on the default target modules the family has (adapters drawn non-zero, so the
  adapters change the function);
- refused: ``packed_support`` names the family and the feature, and ``check_inputs``
  stops the run with that one line (``async-rl train`` exits 2 with it). Besides the
  families, models the packed path must refuse (``OUTSIDE``: a bidirectional gemma3,
  and families with chunked, indexed or other linear attention, or state-space layers)
  are rows of their own.

``scripts/model_matrix.py`` runs this file and renders docs/models.md from its outcome.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from async_rl.cli import main
from async_rl.config import Config
from async_rl.models.families import ARCHITECTURES, tiny_config
from async_rl.run.inputs import check_inputs
from buffers.common.config import ConfigError
from buffers.common.records import TrainSequence
from workers.model_config import LORA_TARGETS, LoraConfig
from workers.trainer.attention import use_packed_attention
from workers.trainer.lora import attach, init_adapters
from workers.trainer.packed_support import packed_support
from workers.trainer.packing import (
    completion_logprobs,
    pack,
    packed_forward,
    padded_logits,
    token_entropy,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPERATURE = 0.7
SHAPES = ((5, 1), (7, 22), (3, 12), (9, 17))
"""(prompt, completion) tokens of the micro-batch: a one-token completion, and rows of
13 to 29 tokens, past the families' sliding window of 8."""
ATOL = 1e-5
GRAD_RTOL = 1e-5
LORA_RANK = 8

REASONS = {arch: packed_support(tiny_config(arch)) for arch in ARCHITECTURES}
EXACT = [arch for arch, reason in REASONS.items() if reason is None]


def micro_batch(seed: int = 0) -> list[TrainSequence]:
    gen = np.random.default_rng(seed)
    out = []
    for i, (prompt, completion) in enumerate(SHAPES):
        ids = gen.integers(3, 259, prompt + completion).astype(np.int32)
        out.append(TrainSequence(
            prompt_token_ids=ids[:prompt], completion_token_ids=ids[prompt:],
            behaviour_logprobs=np.full(completion, -1.0, np.float32), advantage=i - 1.5))
    return out


@dataclass(frozen=True)
class Row:
    """One layout's outcome: log-probs, entropies, and each parameter's gradient."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    grads: dict[str, torch.Tensor | None]


def _grads(model: torch.nn.Module, logprobs: torch.Tensor) -> dict[str, torch.Tensor | None]:
    weights = torch.from_numpy(np.random.default_rng(7).normal(size=logprobs.numel()))
    model.zero_grad(set_to_none=True)
    (logprobs * weights.float()).sum().backward()
    return {name: None if p.grad is None else p.grad.clone()
            for name, p in model.named_parameters() if p.requires_grad}


def padded_row(model: torch.nn.Module, sequences: list[TrainSequence]) -> Row:
    """The model's own forward: eager attention, right-padded rows, its own logits."""
    logits, targets, _ = padded_logits(model, sequences)
    logprobs = completion_logprobs(logits, targets, TEMPERATURE)
    return Row(logprobs.detach(), token_entropy(logits, TEMPERATURE), _grads(model, logprobs))


def packed_row(model: torch.nn.Module, sequences: list[TrainSequence]) -> Row:
    """The trainer's forward: one packed row, packed attention, the fused head."""
    packed = copy.deepcopy(model)
    assert use_packed_attention(packed)
    logprobs, entropy = packed_forward(packed, packed, pack(sequences), TEMPERATURE)
    return Row(logprobs.detach(), entropy, _grads(packed, logprobs))


@functools.cache
def lora_targets(arch: str) -> tuple[str, ...]:
    """The default target modules this family has as linear layers (MoE families keep
    their experts in fused tensors, phi3 its projections in fused layers)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(arch))
    present = {name.rsplit(".", 1)[-1] for name, sub in model.named_modules()
               if isinstance(sub, torch.nn.Linear)}
    return tuple(name for name in LORA_TARGETS if name in present)


@pytest.fixture(scope="module", params=EXACT)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def base(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="eager",
                                            dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rows(base: torch.nn.Module) -> Iterator[tuple[Row, Row]]:
    sequences = micro_batch()
    yield padded_row(base, sequences), packed_row(base, sequences)


@pytest.fixture(scope="module")
def lora_rows(base: torch.nn.Module, arch: str, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Row, Row]:
    lora = LoraConfig(rank=LORA_RANK, target_modules=lora_targets(arch))
    model = attach(copy.deepcopy(base), lora, "")
    init_adapters(model, str(tmp_path_factory.mktemp("no-adapter")), seed=0)
    draws = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 would leave the base model's function
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=draws) * 0.05)
    sequences = micro_batch()
    return padded_row(model, sequences), packed_row(model, sequences)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``got`` within ``ATOL`` of ``want``; else one line saying how far (the matrix's
    table shows it)."""
    assert got.shape == want.shape and want.numel() > 0
    error = float((got - want).abs().max())
    assert error <= ATOL, f"{what} up to {error:.2g} from the model's own padded forward"


def assert_same_grads(got: Row, want: Row) -> None:
    assert got.grads.keys() == want.grads.keys() and len(want.grads) > 0
    compared = 0
    for name, ref in want.grads.items():
        grad = got.grads[name]
        if ref is None or not ref.any():  # an expert no token was routed to
            assert grad is None or not grad.any(), name
            continue
        assert grad is not None, name
        error = float((grad - ref).norm() / ref.norm())
        assert error <= GRAD_RTOL, f"gradient of {name} {error:.2g} off (relative)"
        compared += 1
    assert compared > 0


def test_packed_logprobs_and_entropy_equal_the_padded_eager_forward(
        rows: tuple[Row, Row]) -> None:
    want, got = rows
    assert want.logprobs.shape == (sum(c for _, c in SHAPES),)
    assert_close(got.logprobs, want.logprobs, "log-probs")
    assert_close(got.entropy, want.entropy, "entropies")


def test_packed_gradients_equal_the_padded_eager_forward(rows: tuple[Row, Row]) -> None:
    want, got = rows
    assert_same_grads(got, want)


def test_with_lora_packed_logprobs_and_adapter_gradients_equal_the_padded(
        lora_rows: tuple[Row, Row], arch: str,
        record_property: Callable[[str, object], None]) -> None:
    targets = lora_targets(arch)
    assert targets
    record_property("lora_targets", ", ".join(targets))  # for docs/models.md
    record_property("lora_lacking", ", ".join(t for t in LORA_TARGETS if t not in targets))
    want, got = lora_rows
    assert_close(got.logprobs, want.logprobs, "log-probs")
    assert all(".lora_" in name for name in want.grads)
    assert_same_grads(got, want)


# -- refusals -----------------------------------------------------------------------------

OUTSIDE = {
    "gemma3_bidirectional": "bidirectional attention",
    "llama4_text": "chunked_attention layers",
    "deepseek_v32": "indexed_attention layers",
    "kimi_linear": "linear_attention layers",
    "granitemoehybrid": "recurrent, state-space or convolution layers (mamba_d_state)",
    "lfm2": "recurrent, state-space or convolution layers (conv_L_cache)",
    "mamba2": "recurrent, state-space or convolution layers (state_size)",
}
"""Models outside the families that the packed path must refuse, and the feature each
refusal names: gemma3's bidirectional variant, and transformers' default configs of
families with layers the packed path has no rule for (only their config.json is
written: the check reads nothing else)."""
REFUSED = [*(arch for arch, reason in REASONS.items() if reason is not None), *OUTSIDE]


def refused_config(name: str) -> PretrainedConfig:
    if name == "gemma3_bidirectional":
        config = tiny_config("gemma3")
        config.use_bidirectional_attention = True
        return config
    if name in OUTSIDE:
        return AutoConfig.for_model(name)
    return tiny_config(name)


def test_most_families_train_exactly() -> None:
    assert len(EXACT) >= 12
    assert len(EXACT) + len(REFUSED) - len(OUTSIDE) == len(ARCHITECTURES)


def run_config(model: Path, out: Path, *, packed: bool) -> Config:
    return msgspec.convert({"model": {"path": str(model)}, "trainer": {"packed": packed},
                            "run": {"output_dir": str(out)}}, Config)


@pytest.mark.parametrize("refused", REFUSED)
def test_a_refused_model_stops_at_start_in_one_line(
        refused: str, tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    config = refused_config(refused)
    reason = packed_support(config)
    assert reason is not None
    record_property("reason", reason)  # for docs/models.md
    assert "\n" not in reason and reason.endswith("; set trainer.packed = false")
    assert reason.startswith(f"{config.get_text_config().model_type}: "
                             f"{OUTSIDE.get(refused, '')}")
    config.save_pretrained(tmp_path / "model")  # config.json: all the check reads
    with pytest.raises(ConfigError) as err:
        check_inputs(run_config(tmp_path / "model", tmp_path / "run", packed=True))
    assert str(err.value) == f"config error: trainer.packed = true: {reason}"
    # The padded layout runs the model's own layers: let through.
    checked = check_inputs(run_config(tmp_path / "model", tmp_path / "run", packed=False))
    assert checked.model.path == str(tmp_path / "model")


def test_async_rl_train_on_a_refused_model_exits_2_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = refused_config("gemma3_bidirectional")
    config.save_pretrained(tmp_path / "model")
    toml = tmp_path / "refused.toml"
    toml.write_text(f'[model]\npath = "{tmp_path / "model"}"\n'
                    f'[run]\noutput_dir = "{tmp_path / "run"}"\n')
    assert main(["train", str(toml)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"config error: trainer.packed = true: {packed_support(config)}"]
    assert not (tmp_path / "run").exists()
