"""Prompts from your own dataset (task.kind = "dataset"), read with the ``datasets`` library.

Owns: reading a dataset file (JSONL, JSON, Parquet, CSV, or a ``save_to_disk``
directory) and checking it against the task's keys (``open_dataset``: a ``ConfigError``
naming the key, listing the columns there are), a row as a ``Prompt`` (its prompt text
or chat messages, its answer, every other column, the answer's among them, for the
rewards), the seeded held-out split, refusing rows whose prompt cannot fit the engine's
context (counted), and
``DatasetPromptSource``: the training rows, shuffled anew (seeded) every pass, as an
endless stream with an exact checkpointable cursor. ``load_dataset_task`` assembles the
source and the evaluation prompts. Prompt lengths are measured with the rendering the
rollout workers use (``workers.rollout.prompts``). Knows nothing about engines or Ray.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from async_rl.task_config import DatasetTaskConfig
from async_rl.tasks.sources import IndexedSource, PassOrder
from buffers.common.config import ConfigError
from buffers.common.records import Prompt
from workers.rollout.prompts import PromptFormat, prompt_tokens

if TYPE_CHECKING:
    from datasets import Dataset

log = logging.getLogger("async_rl.tasks")

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""The ``datasets`` builder that reads each file suffix."""
FORMATS = ".jsonl, .json, .parquet, .csv, or a directory written by datasets' save_to_disk"


def _error(key: str, value: object, why: str) -> ConfigError:
    return ConfigError(f"config error: {key} = {value!r}: {why}")


def _reason(err: BaseException) -> str:
    """The innermost cause of a reader's error, on one line."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = " ".join(str(err).split()) or type(err).__name__
    return text[:200]


def read_dataset(path: str, key: str) -> Dataset:
    """The rows of ``path`` (``key`` is the config key that names it, for errors)."""
    import datasets

    # The driver reads it before a run starts: no progress bars or info lines from the
    # library there (a bad input must stay one line).
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    where = Path(path)
    if not where.exists():
        raise _error(key, path, "no such file or directory")
    if where.is_dir():
        try:
            loaded = datasets.load_from_disk(str(where))
        except Exception as err:
            raise _error(key, path, f"not a directory written by datasets' save_to_disk "
                                    f"({_reason(err)})") from None
        if isinstance(loaded, datasets.DatasetDict):
            split = "train" if "train" in loaded or len(loaded) != 1 else next(iter(loaded))
            if split not in loaded:
                raise _error(key, path, f"a DatasetDict without a 'train' split (its "
                                        f"splits: {', '.join(loaded)})")
            loaded = loaded[split]
        dataset = loaded
    else:
        builder = BUILDERS.get(where.suffix.lower())
        if builder is None:
            raise _error(key, path, f"unsupported format (expected {FORMATS})")
        try:
            dataset = datasets.load_dataset(builder, data_files=str(where), split="train")
        except Exception as err:
            raise _error(key, path, f"cannot read it as {where.suffix} ({_reason(err)})"
                         ) from None
    if len(dataset) == 0:
        raise _error(key, path, "the dataset is empty (no rows)")
    return dataset


def content_digest(path: str) -> str:
    """SHA-256 (first 16 hex digits) of a file's bytes, or of a directory's files (names
    and bytes, in order): what a checkpoint's cursor is tied to."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(root) if root.is_dir() else file.name).encode())
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _messages(value: Any) -> tuple[dict[str, str], ...] | None:
    """``value`` as chat messages, or None when it is not a list of them."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
               and isinstance(m.get("content"), str) for m in value):
        return None
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


class DatasetRows:
    """A dataset checked against the task's prompt and answer keys; row ``i`` as a
    ``Prompt`` (``prompt``)."""

    def __init__(self, dataset: Dataset, task: DatasetTaskConfig, *, key: str, path: str,
                 name: str) -> None:
        """``key``, ``path``: the config key naming the file (task.path or
        task.eval_path) and its value; ``name``: the dataset's name (ids, and verl's
        default data_source)."""
        self._dataset, self._name = dataset, name
        self._prompt_key, self._answer_key = task.prompt_key, task.answer_key
        self._chat = task.chat_template
        self._where = f"in {key} = {path!r}"
        columns = list(dataset.column_names)
        for option, column in (("task.prompt_key", task.prompt_key),
                               ("task.answer_key", task.answer_key)):
            if column and column not in columns:
                hint = ' (task.answer_key = "" for none)' if option == "task.answer_key" else ""
                raise _error(option, column, f"no such column {self._where} (its columns: "
                                             f"{', '.join(columns)}){hint}")
        shadowed = "answer" if task.answer_key else ""
        self.columns = tuple(c for c in columns if c not in (task.prompt_key, shadowed))
        """The columns besides the prompt: the rewards get them by name, the answer
        key's too (TRL passes ``solution`` as ``solution``). A column named ``answer``
        is among them only without an answer key (with one, ``answer`` is its value)."""

    @property
    def reward_columns(self) -> tuple[str, ...]:
        """The columns every prompt gives its rewards (``answer`` first)."""
        return ("answer", *(c for c in self.columns if c != "answer"))

    def __len__(self) -> int:
        return len(self._dataset)

    def prompt(self, row: int, prompt_id: str) -> Prompt:
        """Row ``row`` as a prompt with id ``prompt_id``; a prompt that is neither text nor
        chat messages is a ``ConfigError`` naming task.prompt_key and the row."""
        record = dict(self._dataset[row])
        value = record.pop(self._prompt_key)
        answer = record.get(self._answer_key, "") if self._answer_key else ""
        if self._answer_key:  # the rewards' ``answer`` is the answer key's column
            record.pop("answer", None)
        messages = _messages(value)
        if messages is None and not isinstance(value, str):
            raise _error("task.prompt_key", self._prompt_key,
                         f"row {row} {self._where} is {type(value).__name__} "
                         f"{str(value)[:40]!r}: expected a string or a list of chat "
                         "messages ({\"role\", \"content\"})")
        if messages is not None and not self._chat:
            raise _error("task.prompt_key", self._prompt_key,
                         f"row {row} {self._where} holds chat messages: they need "
                         "task.chat_template = true")
        text = messages[-1]["content"] if messages else str(value)
        return Prompt(prompt_id=prompt_id, text=text,
                      answer="" if answer is None else str(answer),
                      messages=messages or (), columns=record, data_source=self._name)


class DatasetPromptSource(IndexedSource):
    """Cycles endlessly through a dataset's training rows, each pass in a new order.

    Prompt ``i`` is row ``train[order(i // n)[i % n]]`` with id ``<name>-<i>``, so ids
    stay unique across passes; pass ``p``'s order is a permutation drawn from
    ``random.Random("<name>/<seed>/<p>")``. The cursor is ``i``; its fingerprint ties it
    to the file's content, the keys, the split and the rows kept.
    """

    def __init__(self, rows: DatasetRows, train: Sequence[int], *, name: str, seed: int,
                 fingerprint: str, refused_too_long: int = 0) -> None:
        if not train:
            raise ValueError("a dataset source needs at least one training row")
        self._rows, self._train = rows, tuple(train)
        self._name = name
        self._fingerprint = fingerprint
        self._next_index = 0
        self._order = PassOrder(len(self._train), name=name, seed=seed)
        self.refused_too_long = refused_too_long
        """Rows (training and held-out) refused: their prompt cannot fit the context."""

    @property
    def name(self) -> str:
        return self._name

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns every prompt gives its rewards (``answer`` first)."""
        return self._rows.reward_columns

    def __len__(self) -> int:
        """Training rows (one pass)."""
        return len(self._train)

    def prompt_at(self, index: int) -> Prompt:
        """The prompt at ``index``, without moving the cursor."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        return self._rows.prompt(self._train[self._order.row(index)], f"{self._name}-{index}")


@dataclass(frozen=True)
class Fit:
    """Which prompts fit the engine: ``tokens`` of prompt plus ``max_new_tokens``
    within ``context`` (0 = no limit known)."""

    tokenizer: Any
    fmt: PromptFormat
    context: int
    max_new_tokens: int

    def __call__(self, prompt: Prompt) -> bool:
        if not self.context:
            return True
        return prompt_tokens(self.tokenizer, prompt, self.fmt) + self.max_new_tokens \
            <= self.context


def model_fit(model_path: str, task: DatasetTaskConfig, max_new_tokens: int) -> Fit:
    """The ``Fit`` of the model at ``model_path``: its tokenizer and context length
    (``max_position_embeddings``, what vLLM sizes the engine's context by)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path)
    context = next((int(v) for a in ("max_position_embeddings", "n_positions",
                                     "max_sequence_length")
                    if isinstance(v := getattr(config, a, None), int)), 0)
    fmt = PromptFormat(chat_template=task.chat_template, system_prompt=task.system_prompt)
    return Fit(AutoTokenizer.from_pretrained(model_path), fmt, context, max_new_tokens)


def split_rows(n: int, fraction: float, *, name: str, seed: int) -> tuple[list[int], list[int]]:
    """``(train, held_out)`` row indices: ``fraction`` of ``n`` rows (at least one when
    the fraction is positive) held out by a permutation seeded by ``seed``; training
    rows in file order, held-out ones in the permutation's."""
    if not fraction:
        return list(range(n)), []
    order = list(range(n))
    random.Random(f"{name}/{seed}/held-out").shuffle(order)
    cut = max(1, round(n * fraction))
    return sorted(order[cut:]), order[:cut]


@dataclass(frozen=True)
class DatasetTask:
    """A dataset task as a run uses it."""

    source: DatasetPromptSource
    """The training rows (``refused_too_long`` says how many rows were refused)."""
    eval_prompts: tuple[Prompt, ...]


def open_dataset(task: DatasetTaskConfig) -> tuple[DatasetRows, DatasetRows | None]:
    """task.path's rows, and task.eval_path's (None without one), checked against the
    keys; ``ConfigError`` naming the key on any problem."""
    name = Path(task.path).stem or Path(task.path).name
    rows = DatasetRows(read_dataset(task.path, "task.path"), task, key="task.path",
                       path=task.path, name=name)
    if not split_rows(len(rows), task.eval_fraction, name=name, seed=task.seed)[0]:
        raise _error("task.eval_fraction", task.eval_fraction,
                     f"holds out all {len(rows)} rows of task.path: none left to train on")
    held = None
    if task.eval_path:
        held = DatasetRows(read_dataset(task.eval_path, "task.eval_path"), task,
                           key="task.eval_path", path=task.eval_path, name=name)
    return rows, held


def load_dataset_task(task: DatasetTaskConfig, fits: Fit) -> DatasetTask:
    """The source and evaluation prompts of ``task`` (kind "dataset"), the rows whose
    prompts do not ``fits`` refused and counted (a ``ConfigError`` when none is left)."""
    rows, held = open_dataset(task)
    name = Path(task.path).stem or Path(task.path).name
    train, eval_rows = split_rows(len(rows), task.eval_fraction, name=name, seed=task.seed)
    kept = [i for i in train if fits(rows.prompt(i, f"{name}-row-{i}"))]
    refused = len(train) - len(kept)
    if not kept:
        raise _error("task.path", task.path,
                     f"no prompt fits the model's context ({fits.context} tokens) with "
                     f"rollout.max_new_tokens = {fits.max_new_tokens}")
    source_rows, candidates = (held, range(len(held))) if held is not None \
        else (rows, eval_rows or kept)
    eval_prompts: list[Prompt] = []
    for i in candidates:
        if len(eval_prompts) >= task.eval_size:
            break
        prompt = source_rows.prompt(i, f"{name}-eval-{len(eval_prompts)}")
        if fits(prompt):
            eval_prompts.append(prompt)
        else:
            refused += 1
    kept_digest = hashlib.sha256(",".join(map(str, kept)).encode()).hexdigest()[:16]
    fingerprint = (f"dataset:name={name}:file={Path(task.path).name}"
                   f":sha256={content_digest(task.path)}:prompt_key={task.prompt_key}"
                   f":answer_key={task.answer_key}:eval_fraction={task.eval_fraction}"
                   f":seed={task.seed}:rows={kept_digest}")
    if refused:
        log.warning("%d prompt(s) of %s refused: longer than the model's context (%d "
                    "tokens) less rollout.max_new_tokens (%d)", refused, task.path,
                    fits.context, fits.max_new_tokens)
    source = DatasetPromptSource(rows, kept, name=name, seed=task.seed,
                                 fingerprint=fingerprint, refused_too_long=refused)
    return DatasetTask(source=source, eval_prompts=tuple(eval_prompts))
