"""Checkpoints: what a stopped run needs to go on, written atomically, verified on load.

Owns: the ``RunState`` record (the orchestrator's side of a checkpoint: version, gate
counters, prompt cursor, prompts to issue again, the replay queue's groups, the partial
rollouts the engines handed back, counters, file positions, what ``[autopilot]`` had
tuned), the layout of
``RUN_DIR/checkpoints/step-NNNNNN/`` (``state.json``, ``queue.msgpack`` with the queue's
groups and their tokens, ``partials.msgpack`` with the partial rollouts, the trainer's
``trainer/`` folder, and ``manifest.json`` with a SHA-256 per file), writing one in two
halves (``begin_checkpoint``: a temporary folder the trainer snapshots its state into;
``finish_checkpoint``, once the trainer's background write is complete: state, queue,
manifest, the rename into place, the oldest beyond ``keep`` removed), refusing a
checkpoint of the other trainer backend (``check_backend``), and finding the newest good
one (``latest_checkpoint``, a ``Checkpoint``: its folder and state; a missing,
mismatching or undecodable file refuses that checkpoint, in one line naming the file,
and the one before it is tried; a checkpoint of the older layout, without a queue or
partials file, holds no queued groups or partial rollouts). Knows nothing about Ray or
what the trainer writes into its folder (``TrainerClient.save_checkpoint``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

import msgspec

from async_rl.control.step_metrics import Counters
from async_rl.run.run_dir import FilePositions
from async_rl.run.run_record import AutopilotState
from async_rl.run.summary import EvalPoint
from async_rl.tasks.sources import SourceState
from buffers.common.partials import PartialGroup, decode_partials, encode_partials
from buffers.common.records import Prompt
from buffers.common.saved_groups import SavedGroup, decode_groups, encode_groups
from buffers.queue.staleness import GateSnapshot

CHECKPOINTS = "checkpoints"
STATE = "state.json"
QUEUE = "queue.msgpack"
"""The replay queue's groups, tokens included (``buffers.common.saved_groups``)."""
PARTIALS = "partials.msgpack"
"""The partial rollouts handed back at the stop (``buffers.common.partials``)."""
MANIFEST = "manifest.json"
TRAINER = "trainer"
"""The trainer's folder in a checkpoint: a Hugging Face model (the rollout engines of a
resumed run start from it) plus the optimizer and RNG state."""


class CheckpointError(Exception):
    """No usable checkpoint: the message is one line for the user."""


class RunState(msgspec.Struct, frozen=True, kw_only=True):
    """The orchestrator's state after ``step`` completed steps."""

    step: int
    version: int
    gate: GateSnapshot
    source: SourceState
    reissue: tuple[Prompt, ...]
    """Admitted (or re-queued) and not trained, nor in ``queue``: issued again, first, on
    resume."""
    queue: tuple[SavedGroup, ...] = ()
    """The replay queue's groups (generated, not trained), oldest first: back in the queue
    on resume. Kept in ``QUEUE`` beside ``STATE``, not in it."""
    partials: tuple[PartialGroup, ...] = ()
    """Partial rollouts the engines handed back (neither owed nor queued): continued
    first on resume. Kept in ``PARTIALS`` beside ``STATE``, not in it."""
    counters: Counters
    evals: tuple[EvalPoint, ...]
    wall_s: float
    """Training wall time up to this step (a resumed run's clock continues from it)."""
    files: FilePositions
    """How far metrics, ledger and evaluations had been written: a resumed run cuts
    them back to here, so no step row or ledger event appears twice."""
    trainer_backend: str = "ddp"
    """trainer.backend of the run that wrote it: the trainer folder's layout differs
    (a replica's state, or every shard's part), so the other backend refuses it."""
    autopilot: AutopilotState | None = None
    """``[autopilot]``'s tuned values and changes (None: without it, or a checkpoint
    written before it was kept): a resumed run starts from them."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


async def begin_checkpoint(run_dir: Path, step: int,
                           save_trainer: Callable[[str], Awaitable[None]]) -> Path:
    """Makes checkpoint ``step``'s temporary folder and has the trainer start writing
    into its ``TRAINER`` folder (``save_trainer`` returns once the trainer holds its
    snapshot); returns the temporary folder, for ``finish_checkpoint``."""
    partial = run_dir / CHECKPOINTS / f".step-{step:06d}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    await save_trainer(str(partial / TRAINER))
    return partial


async def finish_checkpoint(run_dir: Path, partial: Path, state: RunState,
                            trainer_written: Callable[[], Awaitable[None]], keep: int) -> Path:
    """Once ``trainer_written`` returns (the trainer's write is complete), writes the
    state and the manifest, last, and renames the folder into place; returns it.

    The rename makes it visible whole, so a crash leaves either the previous checkpoints
    or this one too.
    """
    await trainer_written()
    root = run_dir / CHECKPOINTS
    final = root / f"step-{state.step:06d}"
    (partial / STATE).write_bytes(msgspec.json.format(msgspec.json.encode(
        msgspec.structs.replace(state, queue=(), partials=()))))
    (partial / QUEUE).write_bytes(encode_groups(state.queue))
    (partial / PARTIALS).write_bytes(encode_partials(state.partials))
    manifest = {str(p.relative_to(partial)): _sha256(p) for p in _files(partial)}
    (partial / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
    shutil.rmtree(final, ignore_errors=True)  # a stale one of the same step (a resumed run)
    os.replace(partial, final)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


async def write_checkpoint(run_dir: Path, state: RunState,
                           save_trainer: Callable[[str], Awaitable[None]],
                           trainer_written: Callable[[], Awaitable[None]], keep: int) -> Path:
    """Writes checkpoint ``step-NNNNNN`` for ``state`` and waits for it; returns its
    folder (``begin_checkpoint`` then ``finish_checkpoint``)."""
    partial = await begin_checkpoint(run_dir, state.step, save_trainer)
    return await finish_checkpoint(run_dir, partial, state, trainer_written, keep)


def check_backend(folder: Path, state: RunState, backend: str) -> None:
    """``CheckpointError`` in one line when ``folder`` was written by another
    trainer.backend than ``backend`` (its trainer folder would not load)."""
    if state.trainer_backend != backend:
        raise CheckpointError(
            f"{folder}: written with trainer.backend = {state.trainer_backend!r}, this run "
            f"has {backend!r}: resume with trainer.backend = {state.trainer_backend!r} "
            "(sharded and replica checkpoints do not convert)")


def _check(folder: Path) -> RunState:
    """The checkpoint's state, or ``CheckpointError`` naming the first bad file."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path}: missing (an incomplete checkpoint)")
    manifest = msgspec.json.decode(manifest_path.read_bytes(), type=dict[str, str])
    for name, digest in manifest.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        if _sha256(path) != digest:
            raise CheckpointError(f"{path}: does not match its checksum (corrupt)")
    try:
        state = msgspec.json.decode((folder / STATE).read_bytes(), type=RunState)
    except msgspec.DecodeError as err:
        raise CheckpointError(f"{folder / STATE}: {err}") from None
    if (folder / QUEUE).is_file():  # the older layout has none: no queued groups kept
        try:
            state = msgspec.structs.replace(
                state, queue=decode_groups((folder / QUEUE).read_bytes()))
        except ValueError as err:
            raise CheckpointError(f"{folder / QUEUE}: {err}") from None
    if (folder / PARTIALS).is_file():  # the older layout has none: no partial rollouts
        try:
            state = msgspec.structs.replace(
                state, partials=decode_partials((folder / PARTIALS).read_bytes()))
        except ValueError as err:
            raise CheckpointError(f"{folder / PARTIALS}: {err}") from None
    return state


class Checkpoint(NamedTuple):
    """A verified checkpoint: where it is and the orchestrator's state in it."""

    folder: Path
    """``RUN_DIR/checkpoints/step-NNNNNN``: the trainer's state is in its ``trainer/``."""
    state: RunState


def latest_checkpoint(run_dir: Path, warn: Callable[[str], None] = print) -> Checkpoint:
    """The newest checkpoint that verifies; each refused one costs one ``warn`` line.
    With none, the error's line names the newest one's bad file."""
    folders = sorted((run_dir / CHECKPOINTS).glob("step-*"), reverse=True)
    refusals: list[str] = []
    for folder in folders:
        try:
            return Checkpoint(folder=folder, state=_check(folder))
        except CheckpointError as err:
            refusals.append(str(err))
            warn(f"checkpoint refused: {err}")
    raise CheckpointError(f"{run_dir}: no usable checkpoint to resume from "
                          f"({len(folders)} refused; newest: {refusals[0]})" if folders else
                          f"{run_dir}: no checkpoint to resume from")
