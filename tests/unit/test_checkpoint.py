"""Checkpoints: written whole or not at all, the last K kept, a bad one refused in one line
naming the file and the one before it used."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from async_rl.control.checkpoint_files import (
    CHECKPOINTS,
    CheckpointError,
    RunState,
    check_backend,
    latest_checkpoint,
    write_checkpoint,
)
from async_rl.control.step_metrics import StepTotals
from async_rl.run.run_dir import FilePositions
from async_rl.tasks.sources import SourceState
from buffers.common.records import Prompt
from buffers.queue.staleness import AdmissionGate


def state(step: int) -> RunState:
    gate = AdmissionGate(groups_per_step=2, max_staleness=1)
    totals = StepTotals()
    totals.groups_trained = 2 * step
    totals.staleness.update([0, 1, 1])
    return RunState(step=step, version=step, gate=gate.snapshot(),
                    source=SourceState(fingerprint="arith", next_index=10 * step),
                    reissue=(Prompt(prompt_id="p1", text="1+1=", answer="2"),),
                    counters=totals.counters(), evals=(), wall_s=1.5 * step,
                    files=FilePositions(metrics=step, ledger=5 * step, evals=1))


async def save_trainer(out_dir: str) -> None:
    Path(out_dir).mkdir(parents=True)
    (Path(out_dir) / "model.safetensors").write_bytes(b"weights" * 100)


async def trainer_written() -> None:
    pass


def write(run_dir: Path, step: int, keep: int = 2) -> Path:
    async def main() -> Path:
        return await write_checkpoint(run_dir, state(step), save_trainer, trainer_written,
                                      keep=keep)

    return anyio.run(main)


def test_the_newest_checkpoint_is_found_and_older_ones_pruned(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        write(tmp_path, step)
    kept = sorted(p.name for p in (tmp_path / CHECKPOINTS).iterdir())
    assert kept == ["step-000002", "step-000003"]
    folder, loaded = latest_checkpoint(tmp_path)
    assert folder.name == "step-000003"
    assert loaded == state(3)  # every field round-trips
    assert loaded.counters.staleness == {0: 1, 1: 2}


def test_a_corrupt_file_refuses_that_checkpoint_and_the_previous_one_is_used(
    tmp_path: Path,
) -> None:
    write(tmp_path, 1)
    newest = write(tmp_path, 2)
    (newest / "trainer" / "model.safetensors").write_bytes(b"flipped")
    warnings: list[str] = []
    folder, loaded = latest_checkpoint(tmp_path, warn=warnings.append)
    assert folder.name == "step-000001" and loaded.step == 1
    assert len(warnings) == 1
    assert "step-000002/trainer/model.safetensors" in warnings[0]
    assert "checksum" in warnings[0]


def test_a_partial_checkpoint_is_never_taken(tmp_path: Path) -> None:
    write(tmp_path, 1)
    # What a crash mid-write leaves: the folder under its temporary name, no manifest.
    partial = tmp_path / CHECKPOINTS / ".step-000002.partial"
    partial.mkdir()
    (partial / "state.json").write_text("{}")
    # And a visible folder with no manifest (written by hand, say) is refused.
    (tmp_path / CHECKPOINTS / "step-000003").mkdir()
    warnings: list[str] = []
    folder, _ = latest_checkpoint(tmp_path, warn=warnings.append)
    assert folder.name == "step-000001"
    assert len(warnings) == 1 and "manifest.json: missing" in warnings[0]


def test_no_usable_checkpoint_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        latest_checkpoint(tmp_path)
    newest = write(tmp_path, 1)
    (newest / "state.json").unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        latest_checkpoint(tmp_path, warn=lambda _: None)


def test_a_checkpoint_of_the_other_trainer_backend_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    folder = write(tmp_path, 1)
    _, saved = latest_checkpoint(tmp_path)
    check_backend(folder, saved, "ddp")  # the backend that wrote it
    with pytest.raises(CheckpointError) as info:
        check_backend(folder, saved, "fsdp2")
    message = str(info.value)
    assert "\n" not in message and "trainer.backend = 'ddp'" in message


def test_the_trainer_folder_says_which_backend_wrote_it(tmp_path: Path) -> None:
    import torch

    from workers.trainer.checkpoint_folder import SHARDED, BackendMismatch, load, written_by

    assert written_by(tmp_path) is None
    (tmp_path / SHARDED).mkdir()
    assert written_by(tmp_path) == "fsdp2"
    model = torch.nn.Linear(2, 2)
    with pytest.raises(BackendMismatch, match=r"resume with trainer\.backend = 'fsdp2'"):
        load(str(tmp_path), backend="ddp", module=model,
             optimizer=torch.optim.AdamW(model.parameters()))
