"""What a weight version carries (``workers.trainer.engine_names``): every family's
parameters under the names, shapes and values of its own checkpoint (what vLLM loads),
parameter by parameter, in the order ``engine_shapes`` announces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from async_rl.models.families import ARCHITECTURES, tiny_config
from workers.trainer.engine_names import engine_shapes, engine_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RENAMED = ("qwen3_moe", "mixtral", "olmoe", "granitemoe", "qwen3_next", "qwen3_5_moe")
"""Families transformers holds otherwise in memory than in their checkpoint."""


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_version_holds_the_checkpoints_weights(arch: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as saved:
        checkpoint = {name: saved.get_tensor(name) for name in saved.keys()}  # noqa: SIM118
    shapes = engine_shapes(model)
    sent = list(engine_weights(model, model.named_parameters()))
    assert len(sent) == len(checkpoint) > 0
    assert [(n, t.shape, t.dtype) for n, t in sent] == shapes
    for name, tensor in sent:
        assert torch.equal(tensor, checkpoint[name]), name
    in_memory = {name for name, _ in model.named_parameters()}
    assert (in_memory != set(checkpoint)) == (arch in RENAMED)
