"""tuned.toml: the user's config file with the tuned keys changed, each saying why.

Owns: ``tuned_text`` (the file's text with each changed ``section.key`` set in its
section, the key's line replaced or added, the section added when absent, and a comment
line above each one) and ``file_values`` (the keys a file sets for a search's values:
``split`` is the rollout workers' and trainer shards' counts). Everything else in the
file, comments included, stays as the user wrote it. Knows nothing about searching.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from async_rl import knobs
from async_rl.config import Config
from async_rl.config_io import toml_value
from async_rl.knobs import SPLIT, Value

_SECTION = re.compile(r"^\s*\[\s*([A-Za-z0-9_.-]+)\s*\]\s*(#.*)?$")


def file_values(tuned: Config, values: Mapping[str, Value]) -> dict[str, Value]:
    """The file's keys for a search's ``values`` (read back from the tuned config):
    ``split`` becomes rollout.num_workers and trainer.num_shards."""
    keys: list[str] = []
    for key in values:
        keys += ["rollout.num_workers", "trainer.num_shards"] if key == SPLIT else [key]
    return {key: knobs.value_of(tuned, key) for key in keys}


def tuned_text(text: str, values: Mapping[str, Any], comments: Mapping[str, str]) -> str:
    """``text`` (a TOML config file) with each ``section.key`` of ``values`` set (a
    table's key as ``section.table.key``), under a ``# comments[key]`` line."""
    lines = text.splitlines()
    for key, value in values.items():
        section, _, name = key.rpartition(".")
        block = [f"# {line}" for line in comments.get(key, "").splitlines()]
        block.append(f"{name} = {toml_value(value)}")
        lines = _set(lines, section, name, block)
    return "\n".join(lines) + "\n"


def _set(lines: list[str], section: str, name: str, block: list[str]) -> list[str]:
    """``lines`` with ``name``'s line in ``[section]`` replaced by ``block`` (added at
    the section's end, or with a new section at the file's end)."""
    current, start, end = "", None, len(lines)
    key_line = re.compile(rf"^\s*{re.escape(name)}\s*=")
    for index, line in enumerate(lines):
        header = _SECTION.match(line)
        if header:
            if current == section:
                end = index
                break
            current = header.group(1)
            if current == section:
                start = index
            continue
        if current == section and key_line.match(line):
            return lines[:index] + block + lines[index + 1:]
    if start is None:
        return [*lines, *([""] if lines and lines[-1].strip() else []),
                f"[{section}]", *block]
    last = end
    while last > start + 1 and not lines[last - 1].strip():
        last -= 1  # after the section's last line, before the blank lines that end it
    return lines[:last] + block + lines[last:]
