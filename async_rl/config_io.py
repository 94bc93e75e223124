"""Reading and writing run configurations: TOML -> ``--set`` overrides -> ``Config``.

Owns: ``load_config`` (a TOML file plus ``--set section.key=value`` overrides, or a
mapping of ``section.key`` to a value),
``decode_config`` (a plain dict), turning any decoding error into one line that names
the key, the value and what is allowed (``ConfigError``), and ``to_toml`` (the resolved
config a run directory keeps). The knobs themselves are ``async_rl.config``'s.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

import msgspec

from async_rl.config import DEFAULT_TASK_KIND, TASK_SECTIONS, Config, unknown_task_key
from buffers.common.config import ConfigError

_PATH_RE = re.compile(r" - at `\$((?:\.[A-Za-z_]\w*|\[\d+\])*)`$")


def _lookup(raw: dict[str, Any], path: str) -> object:
    value: Any = raw
    for part in re.findall(r"\.(\w+)|\[(\d+)\]", path):
        key, index = part
        try:
            value = value[key] if key else value[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _one_line(err: msgspec.ValidationError, raw: dict[str, Any]) -> str:
    message = str(err)
    match = _PATH_RE.search(message)
    path = match.group(1) if match else ""
    detail = message[: match.start()] if match else message
    key = path.lstrip(".")
    unknown = re.match(r"Object contains unknown field `(\w+)`", detail)
    if unknown:
        full = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
        section = _lookup(raw, path)
        value = section.get(unknown.group(1)) if isinstance(section, dict) else None
        if key == "task" and isinstance(section, dict):  # a key of another task.kind's
            refused = unknown_task_key(str(section.get("kind")), unknown.group(1), value)
            return f"config error: {refused}"
        return f"config error: {full} = {value!r}: unknown key"
    missing = re.match(r"Object missing required field `(\w+)`", detail)
    if missing:
        full = f"{key}.{missing.group(1)}" if key else missing.group(1)
        return f"config error: {full}: required key is missing"
    if re.match(r"[\w.\[\]]+ = ", detail):  # raised by a __post_init__ rule: already keyed
        return f"config error: {detail}"
    if key == "task.kind":
        detail = f"expected one of {', '.join(map(repr, TASK_SECTIONS))}"
    elif detail.startswith("Invalid enum value"):
        detail = f"expected one of {_literal_choices(key)}"
    return f"config error: {key} = {_lookup(raw, path)!r}: {detail[:1].lower()}{detail[1:]}"


def _literal_choices(key: str) -> str:
    """The allowed values of a Literal-typed field such as ``weights.update_mode``, or of
    an item of a tuple of them (``run.loggers[1]``)."""
    path, _, index = key.partition("[")
    field: Any = Config
    for name in path.split("."):  # a section, a table inside it (task.environment), a key
        field = _field_types(field)[name]
    field = get_args(field)[0] if index else field
    return ", ".join(repr(choice) for choice in get_args(field))


def _parse_value(text: str) -> Any:
    """An override's value is a TOML value; bare words that are not TOML are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


Overrides = Sequence[str] | Mapping[str, Any]
"""``--set`` items (``"section.key=value"``, the value a TOML value or a bare word), or a
mapping of ``"section.key"`` to a Python value (``async_rl.load_config``'s)."""


def _override_items(overrides: Overrides) -> list[tuple[str, Any, str, str]]:
    """(key, value, the value as shown in an error, the override as given) of each."""
    if isinstance(overrides, Mapping):
        return [(str(key).strip(), value, repr(value), f"{key!r}: expected 'section.key'")
                for key, value in overrides.items()]
    items = []
    for item in overrides:
        key, sep, text = item.partition("=")
        given = f"{item!r}: expected section.key=value"
        if not sep:
            raise ConfigError(f"config error: override {given}")
        items.append((key.strip(), _parse_value(text.strip()), repr(text), given))
    return items


def apply_overrides(raw: dict[str, Any], overrides: Overrides) -> dict[str, Any]:
    """Returns a copy of ``raw`` with each ``section.key`` override applied."""
    merged: dict[str, Any] = {name: dict(section) if isinstance(section, dict) else section
                              for name, section in raw.items()}
    known = {field.encode_name: field.type for field in msgspec.structs.fields(Config)}
    for key, value, shown, given in _override_items(overrides):
        parts = key.split(".")
        if len(parts) not in (2, 3) or not all(parts):
            raise ConfigError(f"config error: override {given}")
        section, name, *inner = parts
        if section not in known:
            raise ConfigError(
                f"config error: {key} = {shown}: unknown section {section!r}"
                f" (one of {', '.join(known)})"
            )
        fields = _field_types(known[section])
        table = fields.get(name)
        if name not in fields or (inner and not _is_table(table)):
            raise ConfigError(f"config error: {key} = {shown}: unknown key")
        if inner:  # a key of a table inside the section: task.environment.max_turns
            assert isinstance(table, type)
            if inner[0] not in {f.encode_name for f in msgspec.structs.fields(table)}:
                raise ConfigError(f"config error: {key} = {shown}: unknown key")
        target = merged.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"config error: {section} = {target!r}: expected a table")
        if inner:
            nested = target[name] = dict(target.get(name) or {})
            nested[inner[0]] = value
        else:
            target[name] = value
    return merged


def _field_types(section: Any) -> dict[str, Any]:
    """The keys of a section (or of a table inside one) and their types; of every member
    for a union of sections (``[task]``: a key of another kind's is refused when the
    config is decoded, naming its kind)."""
    members = get_args(section) or (section,)
    tags = {member.__struct_config__.tag_field: str for member in members
            if member.__struct_config__.tag_field}
    return tags | {f.encode_name: f.type for member in members
                   for f in msgspec.structs.fields(member)}


def _is_table(hint: object) -> bool:
    return isinstance(hint, type) and issubclass(hint, msgspec.Struct)


def decode_config(raw: dict[str, Any]) -> Config:
    """Validates a parsed TOML document into a Config, or raises a one-line ConfigError."""
    task = raw.get("task")
    if isinstance(task, dict) and "kind" not in task:
        raw = {**raw, "task": {"kind": DEFAULT_TASK_KIND, **task}}
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as err:
        raise ConfigError(_one_line(err, raw)) from None


def load_config(path: str | Path, overrides: Overrides | None = None) -> Config:
    """Reads a TOML file, applies the overrides (``--set`` items, or a mapping of
    ``"section.key"`` to a value) and validates the result."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config error: {path}: file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config error: {path}: not valid TOML ({err})") from None
    return decode_config(apply_overrides(raw, overrides or ()))


def to_toml(config: Config) -> str:
    """Renders the resolved config as TOML (every field, defaults included)."""
    lines: list[str] = []
    for section, values in msgspec.to_builtins(config).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """One value as TOML (a table inside a section as an inline table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # a table inside a section (task.environment), inline
        return "{" + ", ".join(f"{toml_value(str(k))} = {toml_value(v)}"
                               for k, v in value.items()) + "}"
    return repr(value)
