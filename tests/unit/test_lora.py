"""LoRA's pure parts: the config section's bounds, adapter names on the wire, the merge
against peft's own, policy folders, and the bytes a version carries."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from async_rl.cli import main
from async_rl.config_io import apply_overrides, decode_config
from async_rl.run.inputs import check_lora_targets
from buffers.common.config import ConfigError
from buffers.common.records import TrainSequence
from workers.model_config import LoraConfig
from workers.trainer.checkpoint_folder import TRAINING_STATE
from workers.trainer.lora import (
    adapter_state,
    attach,
    head_targets,
    init_adapters,
    layer_names,
    merged_state,
    save_policy_folder,
)
from workers.trainer.packing import pack, packed_forward
from workers.weights.adapter import (
    ADAPTER_DIR,
    adapter_shapes,
    is_adapter_version,
    module_name,
    read_adapter,
    wire_name,
)

BASE = '[model]\npath = "runs/tiny-model"\n'


def tiny(tmp_path: Path, **shape: int) -> Path:
    """A randomly initialised Qwen2 saved to ``tmp_path/model`` (config and weights)."""
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         tie_word_embeddings=True, **shape)
    torch.manual_seed(0)
    out = tmp_path / "model"
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.parametrize(("overrides", "key"), [
    (["model.lora.rank=-1"], "model.lora.rank"),
    (["model.lora.rank=513"], "model.lora.rank"),
    (["model.lora.alpha=0"], "model.lora.alpha"),
    (["model.lora.dropout=1.0"], "model.lora.dropout"),
    (["model.lora.rank=8", "model.lora.target_modules=[]"], "model.lora.target_modules"),
    (['model.lora.target_modules=["q_proj", "q_proj"]'], "model.lora.target_modules"),
    (["run.save_merged=true"], "run.save_merged"),
    (["model.lora.rank=8", 'weights.transport="nccl"'], "weights.transport"),
])
def test_bad_lora_settings_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises((ConfigError, Exception)) as info:
        decode_config(apply_overrides(tomllib.loads(BASE), overrides))
    assert key in str(info.value) and "\n" not in str(info.value)


def test_lora_is_off_by_default_with_the_interface_defaults() -> None:
    lora = decode_config(tomllib.loads(BASE)).model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.enabled) == (0, 16, 0.0, False)
    assert lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj")


def test_target_modules_the_model_lacks_exit_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(Qwen2Config(hidden_size=64, num_attention_heads=2,
                                                   num_key_value_heads=1).to_json_string())
    path = tmp_path / "config.toml"
    path.write_text(f'[model]\npath = "{model}"\n[model.lora]\nrank = 8\n'
                    'target_modules = ["q_proj", "query_key_value"]\n'
                    f'[run]\noutput_dir = "{tmp_path}/r"\n')
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "model.lora.target_modules" in err and "'query_key_value'" in err
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_layer_names_are_the_linear_layers_and_the_head_s_full_name(tmp_path: Path) -> None:
    names, head = layer_names(str(tiny(tmp_path)))
    assert set(LoraConfig().target_modules) <= names and "lm_head" in names
    assert head == "lm_head"


@pytest.mark.parametrize("targets", [["q_proj", "lm_head"], ["lm_head"]])
def test_lora_on_the_lm_head_is_refused_in_one_line_naming_the_key(
        tmp_path: Path, targets: list[str]) -> None:
    # The fused head reads the head's base weight: an adapter there would be served by the
    # engines untrained while the trainer's log-probs ignored it.
    model = tiny(tmp_path)
    raw = tomllib.loads(f'[model]\npath = "{model}"\n')
    config = decode_config(apply_overrides(raw, [
        "model.lora.rank=8", f"model.lora.target_modules={json.dumps(targets)}"]))
    with pytest.raises(ConfigError) as info:
        check_lora_targets(config)
    message = str(info.value)
    assert "model.lora.target_modules" in message and "'lm_head'" in message
    assert "\n" not in message


def test_only_the_output_embedding_s_own_name_is_the_head() -> None:
    assert head_targets(["lm_head", "q_proj", "head"], "lm_head") == ["lm_head"]
    assert head_targets(["embed_out", "out"], "gpt_neox.embed_out") == ["embed_out"]
    assert head_targets(["lm_head"], "model.lm_head_norm") == []


def test_the_packed_forward_refuses_an_adapter_on_the_head(tmp_path: Path) -> None:
    path = tiny(tmp_path)
    module = attach(Qwen2ForCausalLM.from_pretrained(path),
                    LoraConfig(rank=2, target_modules=("q_proj", "lm_head")), str(path))
    ids = np.arange(1, 8, dtype=np.int32)  # within the tiny vocabulary
    batch = pack([TrainSequence(prompt_token_ids=ids[:3], completion_token_ids=ids[3:],
                                behaviour_logprobs=np.zeros(4, np.float32), advantage=1.0)])
    with pytest.raises(ValueError, match="LoRA on the output embedding"):
        packed_forward(module, module, batch, 1.0)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.lora_A.default.weight",
                                  "model.layers.11.mlp.down_proj.lora_B.default.weight"])
def test_wire_names_are_peft_saved_names_and_round_trip(name: str) -> None:
    saved = wire_name(name)
    assert saved.startswith("base_model.model.model.layers.") and ".default." not in saved
    assert module_name(saved) == name


def test_adapter_version_needs_adapter_tensors_only() -> None:
    assert not is_adapter_version([])
    assert not is_adapter_version(["a.q_proj.lora_A.weight", "model.embed_tokens.weight"])
    assert is_adapter_version(["a.q_proj.lora_A.weight", "a.q_proj.lora_B.weight"])


def test_merged_state_equals_peft_merge_and_unload(tmp_path: Path) -> None:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    path = tiny(tmp_path)
    lora = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    torch.manual_seed(1)
    ours = attach(Qwen2ForCausalLM.from_pretrained(path), lora, str(path))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.normal_()
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 3 * 2 and all("lora_" in n for n in trainable)
    merged = merged_state(ours.state_dict(), lora)

    reference = get_peft_model(Qwen2ForCausalLM.from_pretrained(path), PeftLoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    reference.load_state_dict({f"base_model.model.{n}": t
                               for n, t in ours.state_dict().items()})
    expected = reference.merge_and_unload().state_dict()
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           Qwen2ForCausalLM.from_pretrained(path).state_dict()[
                               "model.layers.0.self_attn.q_proj.weight"])


def test_a_policy_folder_links_the_base_and_restarts_the_adapter(tmp_path: Path) -> None:
    base = tiny(tmp_path)
    (base / TRAINING_STATE).write_bytes(b"optimizer state stays behind")
    lora = LoraConfig(rank=2, target_modules=("q_proj",))
    module = attach(Qwen2ForCausalLM.from_pretrained(base), lora, str(base))
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_" in name:
                p.fill_(0.5)
    adapters = adapter_state(module.state_dict())
    assert len(adapters) == 2 * 2  # A and B of q_proj in each of 2 layers
    folder = tmp_path / "policy"
    save_policy_folder(folder, base_dir=base, adapter=adapters, lora=lora)
    assert (folder / "model.safetensors").stat().st_ino == (
        base / "model.safetensors").stat().st_ino  # linked, not copied
    assert not (folder / TRAINING_STATE).exists()
    assert set(read_adapter(folder / ADAPTER_DIR)) == set(adapters)
    # A trainer starting from the folder gets the adapter back.
    again = attach(Qwen2ForCausalLM.from_pretrained(folder), lora, str(folder))
    init_adapters(again, str(folder), seed=3)
    for name, tensor in again.state_dict().items():
        torch.testing.assert_close(tensor, module.state_dict()[name])


def test_fresh_adapters_are_the_base_model_and_the_same_for_a_seed(tmp_path: Path) -> None:
    path = tiny(tmp_path)
    lora = LoraConfig(rank=4, target_modules=("q_proj", "up_proj"))
    made = []
    for _ in range(2):
        module = attach(Qwen2ForCausalLM.from_pretrained(path), lora, str(path))
        init_adapters(module, str(path), seed=5)
        made.append(adapter_state(module.state_dict()))
    assert len(made[0]) == 2 * 2 * 2
    assert all(torch.equal(made[0][k], made[1][k]) for k in made[0])
    assert all(t.abs().sum() > 0 if ".lora_A." in k else not t.any()
               for k, t in made[0].items())
    merged = merged_state(module.state_dict(), lora)
    base = Qwen2ForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(merged[k], base[k]) for k in base)


def version_fraction(model_dir: Path, lora: LoraConfig) -> float:
    adapter = sum(math.prod(s) for s in adapter_shapes(str(model_dir), lora).values())
    config = Qwen2Config.from_pretrained(model_dir)
    with torch.device("meta"):
        full = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    return adapter / full


def test_a_rank_8_version_of_a_half_billion_model_is_about_one_percent(
        tmp_path: Path) -> None:
    # Qwen2.5-0.5B's shape (its config.json's numbers); nothing downloaded or allocated.
    model = tmp_path / "qwen2.5-0.5b"
    Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                tie_word_embeddings=True).save_pretrained(model)
    fraction = version_fraction(model, LoraConfig(rank=8))
    # 24 layers x 8 x (2x(896+896) + 2x(896+128) + 3x(896+4864)) = 4.40M of 494M.
    assert fraction == pytest.approx(4_399_104 / 494_032_768)
    assert fraction < 0.01
