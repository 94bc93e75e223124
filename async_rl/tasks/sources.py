"""Built-in prompt sources: a seeded arithmetic task and a JSONL file of prompts.

Owns: the ``PromptSource`` protocol (an endless stream of ``Prompt`` records whose cursor
is a small frozen ``SourceState`` that checkpoints save and restore), the arithmetic
generator with its disjoint held-out eval set, and the JSONL reader with its named
``PromptFileError``. Knows nothing about tokenizers, engines, admission or checkpoints'
file format: a source hands out prompts one at a time and can say where it is.
Rewards for these prompts live in ``async_rl.tasks.rewards``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Protocol

import msgspec

from buffers.common.records import Prompt


class SourceState(msgspec.Struct, frozen=True, kw_only=True):
    """Where a prompt source is: enough to resume it exactly after a restart."""

    fingerprint: str
    """What the source draws from (task parameters, or the file's name and digest);
    restoring into a source with another fingerprint is refused."""
    next_index: Annotated[int, msgspec.Meta(ge=0)]
    """Index of the next prompt to hand out (its id is ``<name>-<next_index>``)."""


class SourceMismatchError(ValueError):
    """A saved ``SourceState`` belongs to a different source than the one restoring it."""


class PromptSource(Protocol):
    """An endless, deterministic stream of prompts with a checkpointable cursor."""

    @property
    def name(self) -> str: ...

    def next_prompt(self) -> Prompt:
        """The prompt at the cursor; advances the cursor by one."""
        ...

    def state(self) -> SourceState: ...

    def restore(self, state: SourceState) -> None:
        """Moves the cursor to ``state.next_index``; raises ``SourceMismatchError`` when
        the state came from another source."""
        ...


class IndexedSource:
    """The cursor shared by sources that can make prompt ``i`` directly: hands out
    ``prompt_at(i)``, ``prompt_at(i + 1)``, ... and checkpoints ``i``. A subclass sets
    ``_fingerprint`` and defines ``prompt_at``."""

    _fingerprint: str
    _next_index: int = 0
    prompt_at: Callable[[int], Prompt]

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def next_prompt(self) -> Prompt:
        prompt = self.prompt_at(self._next_index)
        self._next_index += 1
        return prompt

    def __iter__(self) -> Iterator[Prompt]:
        while True:
            yield self.next_prompt()

    def state(self) -> SourceState:
        return SourceState(fingerprint=self._fingerprint, next_index=self._next_index)

    def restore(self, state: SourceState) -> None:
        if state.fingerprint != self._fingerprint:
            raise SourceMismatchError(
                f"cannot restore prompt cursor: saved for {state.fingerprint!r}, "
                f"this source is {self._fingerprint!r}"
            )
        self._next_index = state.next_index


class PassOrder:
    """Which of ``size`` rows prompt ``i`` is, cycling through them pass after pass: in
    order, or (``shuffle``) each pass ``p`` in a permutation drawn from
    ``random.Random("<name>/<seed>/<p>")``, the current pass's kept."""

    def __init__(self, size: int, *, name: str, seed: int, shuffle: bool = True) -> None:
        self._size, self._name, self._seed, self._shuffle = size, name, seed, shuffle
        self._pass = -1
        self._order: list[int] = []

    def row(self, index: int) -> int:
        epoch, offset = divmod(index, self._size)
        if not self._shuffle:
            return offset
        if epoch != self._pass:
            self._order = list(range(self._size))
            random.Random(f"{self._name}/{self._seed}/{epoch}").shuffle(self._order)
            self._pass = epoch
        return self._order[offset]


# ---------------------------------------------------------------------------------------
# Arithmetic


def stable_unit(key: str) -> float:
    # sha256 rather than hash(): Python's str hash changes per process (PYTHONHASHSEED).
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


class ArithmeticTask(IndexedSource):
    """Endless ``a+b=`` / ``a-b=`` prompts over operands ``0..max_operand``.

    Prompt text is e.g. ``"12+7="``; the answer is the integer result as text (``"19"``).
    Subtraction keeps ``a >= b`` so answers are never negative. Prompt ``i`` is drawn from
    ``random.Random("<name>/<seed>/<i>")`` (string seeds are hashed with SHA-512, so the
    stream is the same in every process), so it depends on nothing but seed and index.

    A fixed slice of the problem space (``held_out_fraction`` of all ``(op, a, b)``
    triples, chosen by a seed-independent digest) never appears in training prompts;
    ``eval_prompts`` draws only from it, so eval accuracy measures generalisation rather
    than recall of trained problems.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        max_operand: int = 29,
        ops: str = "+-",
        held_out_fraction: float = 0.2,
        name: str = "arith",
    ) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        if not ops or set(ops) - {"+", "-"}:
            raise ValueError(f"ops must be a non-empty string of '+' and '-', got {ops!r}")
        if not 0.0 < held_out_fraction < 0.5:
            raise ValueError(f"held_out_fraction must be in (0, 0.5), got {held_out_fraction}")
        self._seed = seed
        self._max_operand = max_operand
        self._ops = "".join(sorted(set(ops), key=ops.index))
        self._held_out_fraction = held_out_fraction
        self._name = name
        self._next_index = 0
        self._fingerprint = (
            f"arith:name={self._name}:seed={self._seed}:max_operand={self._max_operand}"
            f":ops={self._ops}:held_out={self._held_out_fraction}"
        )

    @property
    def name(self) -> str:
        return self._name

    @property
    def max_answer_chars(self) -> int:
        """Longest answer in characters; an engine's ``max_tokens`` must exceed it."""
        largest = 2 * self._max_operand if "+" in self._ops else self._max_operand
        return len(str(largest))

    def is_held_out(self, op: str, a: int, b: int) -> bool:
        """True for problems reserved for evaluation (never in the training stream)."""
        return stable_unit(f"held-out:{a}{op}{b}") < self._held_out_fraction

    def _all_problems(self) -> Iterator[tuple[str, int, int]]:
        for op in self._ops:
            for a in range(self._max_operand + 1):
                for b in range(self._max_operand + 1):
                    if op == "-" and b > a:
                        continue
                    yield op, a, b

    def _draw(self, rng: random.Random) -> tuple[str, int, int]:
        # Rejection sampling: held-out problems are a small fraction, so few retries.
        while True:
            op = rng.choice(self._ops)
            a = rng.randint(0, self._max_operand)
            b = rng.randint(0, self._max_operand)
            if op == "-" and b > a:
                a, b = b, a
            if not self.is_held_out(op, a, b):
                return op, a, b

    def _make_prompt(self, prompt_id: str, op: str, a: int, b: int) -> Prompt:
        result = a + b if op == "+" else a - b
        return Prompt(prompt_id=prompt_id, text=f"{a}{op}{b}=", answer=str(result))

    def prompt_at(self, index: int) -> Prompt:
        """The training prompt at ``index``, without moving the cursor."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        op, a, b = self._draw(random.Random(f"{self._name}/{self._seed}/{index}"))
        return self._make_prompt(f"{self._name}-{index}", op, a, b)

    def teacher_completion(self, prompt: Prompt, rng: random.Random, accuracy: float) -> str:
        """The warm start's target: the answer, one too high ``1 - accuracy`` of the time."""
        return prompt.answer if rng.random() < accuracy else str(int(prompt.answer) + 1)

    def eval_prompts(self, n: int = 200) -> tuple[Prompt, ...]:
        """``n`` distinct held-out problems in a fixed order (ids ``<name>-eval-<i>``).

        Independent of the cursor and of ``seed``, so every run with the same task
        parameters is measured on the same set. Raises ``ValueError`` when fewer than
        ``n`` held-out problems exist.
        """
        pool = [p for p in self._all_problems() if self.is_held_out(*p)]
        if n > len(pool):
            raise ValueError(
                f"eval set of {n} asked for, but only {len(pool)} held-out problems exist "
                f"(raise max_operand or held_out_fraction)"
            )
        random.Random(f"{self._name}/eval").shuffle(pool)
        return tuple(
            self._make_prompt(f"{self._name}-eval-{i}", op, a, b)
            for i, (op, a, b) in enumerate(pool[:n])
        )


# ---------------------------------------------------------------------------------------
# JSONL


class PromptFileError(ValueError):
    """A prompt file could not be read; names the file and (when known) the line."""

    def __init__(self, path: Path, line: int | None, reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")


class _JsonlRecord(msgspec.Struct, frozen=True):
    # Extra keys (ids, metadata) are ignored: datasets carry them, the task does not.
    prompt: str
    answer: str | int | float


_decode_record = msgspec.json.Decoder(_JsonlRecord).decode


def read_prompt_file(path: str | Path) -> tuple[tuple[str, str], ...]:
    """``(prompt, answer)`` pairs from a JSONL file, one object per non-blank line.

    Raises ``PromptFileError`` naming the file and 1-based line number for a line that
    is not JSON, not an object, or lacks a string ``prompt`` / an ``answer``.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PromptFileError(path, None, f"cannot read: {exc.strerror or exc}") from exc
    rows: list[tuple[str, str]] = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = _decode_record(line)
        except msgspec.ValidationError as exc:
            expected = 'expected {"prompt": string, "answer": string or number}'
            raise PromptFileError(path, number, f"{expected}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise PromptFileError(path, number, f"invalid JSON: {exc}") from None
        rows.append((record.prompt, str(record.answer)))
    if not rows:
        raise PromptFileError(path, None, "no prompts (the file is empty)")
    return tuple(rows)


class JsonlPromptSource(IndexedSource):
    """Cycles endlessly through a JSONL file of ``{"prompt": ..., "answer": ...}`` lines.

    Prompt ``i`` is record ``order(i // n)[i % n]`` and has id ``<name>-<i>``, so ids stay
    unique across passes. Without ``shuffle`` every pass is in file order; with it, each
    pass is a permutation drawn from ``random.Random("<name>/<seed>/<pass>")``. The file is
    read once, at construction.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        name: str | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        self._path = Path(path)
        self._rows = read_prompt_file(self._path)
        self._name = name if name is not None else self._path.stem
        self._order = PassOrder(len(self._rows), name=self._name, seed=seed, shuffle=shuffle)
        self._next_index = 0
        digest = hashlib.sha256(self._path.read_bytes()).hexdigest()[:16]
        self._fingerprint = (
            f"jsonl:name={self._name}:file={self._path.name}:sha256={digest}"
            f":shuffle={shuffle}:seed={seed}"
        )

    @property
    def name(self) -> str:
        return self._name

    def __len__(self) -> int:
        """Records in the file (one pass)."""
        return len(self._rows)

    def prompt_at(self, index: int) -> Prompt:
        """The prompt at ``index``, without moving the cursor."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        text, answer = self._rows[self._order.row(index)]
        return Prompt(prompt_id=f"{self._name}-{index}", text=text, answer=answer)

