"""Checkpoints: written whole or not at all, the last K kept, a bad one refused in one line
naming the file and the one before it used; the queue's groups and the partial rollouts
kept in files of their own, a checkpoint of the older layout (without them) still
read."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import anyio
import msgspec
import pytest

from async_rl.control.checkpoint_files import (
    CHECKPOINTS,
    MANIFEST,
    PARTIALS,
    QUEUE,
    STATE,
    CheckpointError,
    RunState,
    check_backend,
    latest_checkpoint,
    write_checkpoint,
)
from async_rl.control.step_metrics import StepTotals
from async_rl.run.run_dir import FilePositions
from async_rl.tasks.sources import SourceState
from buffers.common.partials import PartialGroup, PartialSample
from buffers.common.records import Prompt, Sample, make_group
from buffers.common.saved_groups import SavedGroup
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
                    files=FilePositions(metrics=step, ledger=5 * step, evals=1),
                    queue=(queued(f"q{step}", version=step),),
                    partials=(partial(f"r{step}", version=step),))


def partial(prompt_id: str, version: int) -> PartialGroup:
    """A partial group: one sample cut short after 2 tokens, one with none, one done."""
    cut = PartialSample(token_ids=(5, 6), logprobs=(-0.1, -1 / 3), versions=(version - 1, version))
    return PartialGroup(prompt=Prompt(prompt_id=prompt_id, text="1+1=", answer="2"),
                        prompt_token_ids=(1, 2),
                        samples=(cut, PartialSample(token_ids=(), logprobs=(), versions=()),
                                 msgspec.structs.replace(cut, finish_reason="stop")))


def queued(prompt_id: str, version: int) -> SavedGroup:
    sample = Sample(token_ids=(5, 6, 7), logprobs=(-0.5, -0.25, -1.0),
                    versions=(version,) * 3, finish_reason="stop", text="x", reward=1.0)
    group = make_group(Prompt(prompt_id=prompt_id, text="1+1=", answer="2"), (1, 2),
                       [sample, sample])
    return SavedGroup(group=msgspec.structs.replace(group, tokens=None), tokens=group.tokens,
                      entered_version=version)


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
    assert msgspec.structs.replace(loaded, queue=()) == msgspec.structs.replace(state(3),
                                                                                queue=())
    (group,) = loaded.queue  # every field round-trips, the queue's tokens included
    assert group.group == state(3).queue[0].group and group.entered_version == 3
    assert group.tokens is not None and group.tokens.logprobs.tolist() == [-0.5, -0.25, -1.0] * 2
    assert json.loads((folder / STATE).read_text())["queue"] == []  # kept in QUEUE only
    # The partial rollouts too, bit for bit (a float64 log-prob included), in PARTIALS.
    assert loaded.partials == state(3).partials and loaded.partials[0].min_version == 2
    assert loaded.partials[0].samples[0].logprobs[1] == -1 / 3
    assert json.loads((folder / STATE).read_text())["partials"] == []
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


def to_older_layout(folder: Path) -> None:
    """The checkpoint in ``folder`` as one written before the queue and the partial
    rollouts were kept: no queue or partials file, neither in the state (what it held
    of them is lost: use it on one without)."""
    old = json.loads((folder / STATE).read_text())
    manifest = json.loads((folder / MANIFEST).read_text())
    for name, key in ((QUEUE, "queue"), (PARTIALS, "partials")):
        (folder / name).unlink()
        del old[key], manifest[name]
    (folder / STATE).write_text(json.dumps(old))
    manifest[STATE] = hashlib.sha256((folder / STATE).read_bytes()).hexdigest()
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_a_checkpoint_of_the_older_layout_without_a_queue_file_is_read(
    tmp_path: Path,
) -> None:
    """What a checkpoint written before the queue was kept looks like: no queue file,
    no queue in the state: it holds no queued groups (their prompts are in reissue)."""
    to_older_layout(write(tmp_path, 1))
    _, loaded = latest_checkpoint(tmp_path)
    assert loaded.queue == () and loaded.step == 1 and len(loaded.reissue) == 1
    assert loaded.partials == ()


@pytest.mark.parametrize("name", [QUEUE, PARTIALS])
@pytest.mark.parametrize("damage", ["bytes changed", "checksum matches, content does not"])
def test_a_corrupt_queue_or_partials_file_fails_the_resume_in_one_line_naming_it(
    tmp_path: Path, damage: str, name: str
) -> None:
    folder = write(tmp_path, 1)
    (folder / name).write_bytes((folder / name).read_bytes()[:-7])
    if damage != "bytes changed":  # a writer that wrote nonsense, and hashed it
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest[name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        (folder / MANIFEST).write_text(json.dumps(manifest))
    warnings: list[str] = []
    with pytest.raises(CheckpointError) as info:
        latest_checkpoint(tmp_path, warn=warnings.append)
    message = str(info.value)
    assert "\n" not in message and f"step-000001/{name}" in message, message
    assert len(warnings) == 1 and name in warnings[0]


@pytest.mark.parametrize("name", [QUEUE, PARTIALS])
def test_resume_with_a_corrupt_queue_or_partials_file_exits_2_before_anything_starts(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    from async_rl.cli import main
    from async_rl.config_io import decode_config, to_toml
    from async_rl.run.run_dir import CONFIG

    out = tmp_path / "run"
    out.mkdir()
    (out / CONFIG).write_text(to_toml(decode_config({
        "model": {"path": str(tiny_model_dir)}, "task": {"eval_size": 0},
        "run": {"output_dir": str(out), "progress": False}})))
    folder = write(out, 1)
    (folder / name).write_bytes(b"\x00" + (folder / name).read_bytes()[1:])
    before = sorted(p.name for p in out.iterdir())
    assert main(["train", "--resume", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("resume error: ") and f"step-000001/{name}" in err[-1], err
    assert sorted(p.name for p in out.iterdir()) == before  # no worker, no run file
