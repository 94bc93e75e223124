"""The rows of an agent task (task.kind = "agent"): a JSONL file of JSON objects.

Owns: ``read_agent_rows`` (the file's objects, one per non-blank line, refused in one
line naming the file and the line) and ``AgentRowSource`` (the endless, checkpointable
stream of them as prompts: each row's whole object rides on ``Prompt.columns``, which
the agent's ``solve`` gets as its ``row``; ``Prompt.text`` and ``answer`` are its
``prompt`` and ``answer`` keys when it has them, for the ledger and logs). Knows nothing
about agents or the gateway.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec

from async_rl.tasks.sources import IndexedSource, PassOrder, PromptFileError
from buffers.common.records import Prompt


def read_agent_rows(path: str | Path) -> tuple[dict[str, Any], ...]:
    """The JSON objects of ``path``, one per non-blank line; ``PromptFileError`` naming
    the file (and the line) for one that cannot be read, is not JSON or not an object, or
    for a file without any."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PromptFileError(path, None, f"cannot read: {exc.strerror or exc}") from exc
    rows = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            raise PromptFileError(path, number, f"invalid JSON: {exc}") from None
        if not isinstance(row, dict):
            raise PromptFileError(path, number, f"expected a JSON object, got "
                                                f"{type(row).__name__}")
        rows.append(row)
    if not rows:
        raise PromptFileError(path, None, "no rows (the file is empty)")
    return tuple(rows)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class AgentRowSource(IndexedSource):
    """Cycles through the rows of ``path`` (each pass in a permutation seeded by
    ``seed``); prompt ``i`` has id ``<name>-<i>``."""

    def __init__(self, path: str | Path, *, seed: int = 0, shuffle: bool = True) -> None:
        self._path = Path(path)
        self._rows = read_agent_rows(self._path)
        self._name = self._path.stem
        self._order = PassOrder(len(self._rows), name=self._name, seed=seed, shuffle=shuffle)
        self._next_index = 0
        digest = hashlib.sha256(self._path.read_bytes()).hexdigest()[:16]
        self._fingerprint = (f"agent:file={self._path.name}:sha256={digest}"
                             f":shuffle={shuffle}:seed={seed}")

    @property
    def name(self) -> str:
        return self._name

    def __len__(self) -> int:
        return len(self._rows)

    def row_prompt(self, row: int, prompt_id: str) -> Prompt:
        """Row ``row`` (file order) as a prompt with id ``prompt_id``."""
        data = self._rows[row]
        return Prompt(prompt_id=prompt_id, text=_text(data.get("prompt", "")),
                      answer=_text(data.get("answer", "")), columns=dict(data))

    def prompt_at(self, index: int) -> Prompt:
        """The prompt at ``index``, without moving the cursor."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        return self.row_prompt(self._order.row(index), f"{self._name}-{index}")

    def eval_prompts(self, n: int) -> tuple[Prompt, ...]:
        """The first ``n`` rows in file order (ids ``<name>-eval-<i>``): trained on too."""
        return tuple(self.row_prompt(i, f"{self._name}-eval-{i}")
                     for i in range(min(n, len(self._rows))))
