"""The trainer's checkpoint snapshot: copies that training cannot change, refilled in
place from one checkpoint to the next, written by a low-priority thread."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from workers.trainer.checkpoint_folder import TRAINING_STATE, CheckpointWriter, _copy


def _optimizer_state() -> dict[str, object]:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return {"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}


def test_a_snapshot_is_a_copy_and_the_next_one_refills_its_buffers() -> None:
    state = _optimizer_state()
    first = _copy(state)
    live = state["optimizer"]["state"][0]["exp_avg"]  # type: ignore[index]
    kept = first["optimizer"]["state"][0]["exp_avg"]
    assert kept.data_ptr() != live.data_ptr() and torch.equal(kept, live)
    live.add_(1.0)  # training moves on: the snapshot does not
    assert not torch.equal(kept, live)
    second = _copy(state, first)
    again = second["optimizer"]["state"][0]["exp_avg"]
    assert again.data_ptr() == kept.data_ptr() and torch.equal(again, live)
    assert second["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # type: ignore[index]


def test_a_snapshot_of_another_structure_allocates_afresh() -> None:
    first = _copy({"a": torch.zeros(3)})
    other = _copy({"a": torch.zeros(4)}, first)
    renamed = _copy({"b": torch.zeros(3)}, first)
    assert other["a"].shape == (4,) and other["a"].data_ptr() != first["a"].data_ptr()
    assert renamed["b"].data_ptr() != first["a"].data_ptr()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux thread priorities")
def test_the_writer_thread_runs_at_the_lowest_priority(tmp_path: Path) -> None:
    seen: dict[str, int] = {}
    writer = CheckpointWriter(rank=0, backend="ddp")
    model = torch.nn.Linear(2, 2)

    class Tokenizer:
        def save_pretrained(self, out: Path) -> None:
            seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    class Module(torch.nn.Module):
        def save_pretrained(self, out: Path, state_dict: dict[str, torch.Tensor]) -> None:
            seen["tensors"] = len(state_dict)

    optimizer = torch.optim.AdamW(model.parameters())
    writer.start(str(tmp_path / "c"), module=Module(), optimizer=optimizer,
                 whole=dict(model.state_dict()), tokenizer=Tokenizer())
    writer.close()
    assert seen == {"nice": 19, "tensors": 2}
    assert (tmp_path / "c" / TRAINING_STATE).is_file()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19  # this one's unchanged


def test_sharded_state_on_cpu_is_refilled_in_place_too(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    try:
        model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        first = _copy(dict(zip(("model", "optim"), get_state_dict(model, optimizer),
                               strict=True)))
        weight = first["model"]["weight"]
        assert isinstance(weight, DTensor)
        with torch.no_grad():
            model.weight.add_(1.0)  # type: ignore[operator]
        second = _copy(dict(zip(("model", "optim"), get_state_dict(model, optimizer),
                                strict=True)), first)
        assert second["model"]["weight"] is weight
        assert torch.equal(weight.to_local(), model.weight.to_local())  # type: ignore[operator]
    finally:
        dist.destroy_process_group()


class _Folder(torch.nn.Module):
    """A module that records what would be written as a Hugging Face model."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 3)
        self.written: dict[str, torch.Tensor] = {}

    def save_pretrained(self, out: Path, state_dict: dict[str, torch.Tensor]) -> None:
        self.written = state_dict


class _NoTokenizer:
    def save_pretrained(self, out: Path) -> None:
        pass


def test_prepared_buffers_are_the_ones_the_first_checkpoint_fills(tmp_path: Path) -> None:
    module = _Folder()
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module.inner(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    writer = CheckpointWriter(rank=0, backend="ddp")
    assert not writer.prepared
    writer.prepare(module=module, optimizer=optimizer, whole=dict(module.state_dict()))
    writer.wait()
    assert writer.prepared
    sharded, whole = writer._copies
    made = sharded["optimizer"]["state"][0]["exp_avg"]
    made_weight = whole["inner.weight"]
    # Made beforehand, written once (zeros), not yet the state's values.
    assert float(made.abs().sum()) == 0.0 and float(made_weight.abs().sum()) == 0.0
    with torch.no_grad():
        module.inner.weight.add_(1.0)  # training moves on before the checkpoint
    writer.start(str(tmp_path / "c"), module=module, optimizer=optimizer,
                 whole=dict(module.state_dict()), tokenizer=_NoTokenizer())
    writer.close()
    assert module.written["inner.weight"] is made_weight
    assert torch.equal(made_weight, module.inner.weight)
    saved = torch.load(tmp_path / "c" / TRAINING_STATE, weights_only=True)
    live = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], live)
    assert sharded["optimizer"]["state"][0]["exp_avg"] is made


def test_buffers_from_meta_shapes_are_allocated_on_cpu() -> None:
    from workers.trainer.checkpoint_folder import _allocate

    made = _allocate({"w": torch.empty(3, 2, dtype=torch.bfloat16, device="meta"), "n": 7})
    assert made["w"].device.type == "cpu" and made["w"].shape == (3, 2)
    assert made["w"].dtype == torch.bfloat16 and made["n"] is None
