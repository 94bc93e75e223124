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
  stops the run with that one line (``async-rl train`` exits 2 with it).

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
from transformers import AutoModelForCausalLM

from async_rl.cli import main
from async_rl.config import Config
from async_rl.models.families import ARCHITECTURES, build_family_model, tiny_config
from async_rl.run.inputs import check_inputs
from buffers.config import ConfigError
from buffers.records import TrainSequence
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
REFUSED = [arch for arch, reason in REASONS.items() if reason is not None]


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


def test_most_families_train_exactly_and_each_refusal_names_its_family() -> None:
    assert len(EXACT) >= 12
    for arch in REFUSED:
        reason = REASONS[arch]
        assert reason is not None and "\n" not in reason
        assert reason.startswith(f"{tiny_config(arch).model_type}: ")
        assert reason.endswith("set trainer.packed = false")


@functools.cache
def family_dir(arch: str, root: Path) -> Path:
    return build_family_model(arch, root / arch)


def run_config(model: Path, out: Path, *, packed: bool) -> Config:
    return msgspec.convert({"model": {"path": str(model)}, "trainer": {"packed": packed},
                            "run": {"output_dir": str(out)}}, Config)


@pytest.mark.parametrize("refused", REFUSED)
def test_a_refused_family_stops_at_start_in_one_line(
        refused: str, tmp_path_factory: pytest.TempPathFactory,
        record_property: Callable[[str, object], None]) -> None:
    record_property("reason", REASONS[refused])  # for docs/models.md
    root = tmp_path_factory.getbasetemp()
    model, out = family_dir(refused, root), root / "run"
    with pytest.raises(ConfigError) as err:
        check_inputs(run_config(model, out, packed=True))
    assert str(err.value) == f"config error: trainer.packed = true: {REASONS[refused]}"
    # The padded layout runs the model's own attention and head: let through.
    assert check_inputs(run_config(model, out, packed=False)).model.path == str(model)


def test_async_rl_train_on_a_refused_family_exits_2_in_one_line(
        tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    assert REFUSED
    refused = REFUSED[0]
    root = tmp_path_factory.getbasetemp()
    config = root / "refused.toml"
    config.write_text(f'[model]\npath = "{family_dir(refused, root)}"\n'
                      f'[run]\noutput_dir = "{root / "refused-run"}"\n')
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"config error: trainer.packed = true: {REASONS[refused]}"]
    assert not (root / "refused-run").exists()
