"""Generates ``docs/config.md``, the reference of every config key, from the config itself.

Owns: walking ``async_rl.config.Config`` (each section field, in declaration order, and each
field of that section's Struct), rendering a key's type (bounds from ``msgspec.Meta``,
``Literal`` choices, arrays), its default in TOML form and its docstring, read from the
class source (msgspec keeps no attribute docstrings), into one markdown page. Section
names and class locations come from ``Config``'s annotations, never from this file.

    python scripts/config_docs.py            # print the page
    python scripts/config_docs.py --write    # write docs/config.md
    python scripts/config_docs.py --check    # exit 1 if docs/config.md is out of date

``tests/unit/test_config_docs.py`` fails when the page is out of date.
"""

from __future__ import annotations

import argparse
import ast
import enum
import inspect
import itertools
import json
import math
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import msgspec

ROOT = Path(__file__).resolve().parent.parent
DOCS_PATH = ROOT / "docs" / "config.md"
COMMAND = "python scripts/config_docs.py --write"


def root_config() -> type[msgspec.Struct]:
    """``async_rl.config.Config``, importable from a checkout that is not installed."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from async_rl.config import Config

    return Config


class Key(msgspec.Struct, frozen=True):
    """One leaf key of the config: ``section.name``."""

    section: str
    name: str
    type: str
    default: str
    doc: str

    @property
    def full(self) -> str:
        return f"{self.section}.{self.name}"


class Section(msgspec.Struct, frozen=True):
    """One ``[section]`` table of the config and its keys."""

    name: str
    doc: str
    keys: tuple[Key, ...]
    title: str = ""
    """The heading, when it is not ``[name]``: one member of a tagged union."""


def field_docs(cls: type) -> dict[str, str]:
    """Maps each attribute name of ``cls`` (and its Struct bases) to its docstring: the string
    expression right after the annotated assignment ``name: type = ...`` in the class body."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, msgspec.Struct) or not issubclass(klass, msgspec.Struct):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        tree = ast.parse(source)
        body = next(
            (node.body for node in tree.body
             if isinstance(node, ast.ClassDef) and node.name == klass.__name__),
            [],
        )
        for stmt, following in itertools.pairwise(body):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(following.value.value)
    return docs


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("multiple_of", "multiple of"),
           ("min_length", "length >="), ("max_length", "length <="), ("pattern", "matching"))
_NAMES: dict[object, str] = {int: "int", float: "float", str: "str", bool: "bool",
                             bytes: "bytes", Any: "any", type(None): "none"}


def _number(value: object) -> object:
    """A bound as the page shows it: 0 and 0.0 alike. ``Annotated`` types are cached by
    equality, so ``Meta(ge=0)`` and ``Meta(ge=0.0)`` share one object, and which of the
    two a field gets depends on import order: the page must not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def render_type(hint: object) -> str:
    """A readable name for a field's annotation: ``int >= 1``, ``"a" | "b"``, ``list[int]``.

    Works on the ``typing`` annotation, not on ``msgspec.inspect``'s, which sorts the choices
    of a ``Literal``: here they keep the order they are declared in."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        bounds = [f"{op} {_toml(value) if attr == 'pattern' else _number(value)}"
                  for meta in getattr(hint, "__metadata__", ()) if isinstance(meta, msgspec.Meta)
                  for attr, op in _BOUNDS if (value := getattr(meta, attr)) is not None]
        base = render_type(args[0])
        return f"{base} {', '.join(bounds)}" if bounds else base
    if origin is Literal:
        return " | ".join(_toml(value) for value in args)
    if origin in (Union, types.UnionType):
        return " | ".join(render_type(arg) for arg in args)
    if origin in (list, set, frozenset) or (origin is tuple and args[1:] == (...,)):
        return f"list[{render_type(args[0]) if args else 'any'}]"
    if origin is tuple:
        return "[" + ", ".join(render_type(arg) for arg in args) + "]"
    if origin is dict:
        return f"table[{', '.join(render_type(arg) for arg in args)}]"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " | ".join(_toml(member.value) for member in hint)
    if isinstance(hint, type) and hint not in _NAMES:
        return f"table ({hint.__name__})" if issubclass(hint, msgspec.Struct) else hint.__name__
    return _NAMES.get(hint, str(hint))


def _toml(value: object) -> str:
    """``value`` as it would be written in a TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list | tuple | set | frozenset):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if value is None:
        return "unset"
    if isinstance(value, msgspec.Struct):
        return "(its defaults)"
    return _toml(msgspec.to_builtins(value))


def _default(field: msgspec.inspect.Field) -> str:
    if field.required:
        return "required"
    if field.default is not msgspec.NODEFAULT:
        return _toml(field.default)
    return _toml(field.default_factory())


def sections(config: type[msgspec.Struct] | None = None) -> Iterator[Section]:
    """Each section of ``config`` (default: the run's ``Config``), in declaration order, with
    its keys in declaration order."""
    config = config or root_config()
    root = msgspec.inspect.type_info(config)
    assert isinstance(root, msgspec.inspect.StructType)
    for section_field in root.fields:
        section_type = section_field.type
        if isinstance(section_type, msgspec.inspect.UnionType) and all(
                isinstance(member, msgspec.inspect.StructType) and member.tag_field
                for member in section_type.types):
            yield from _tagged_sections(section_field.encode_name, section_type.types)
            continue
        if not isinstance(section_type, msgspec.inspect.StructType):
            raise TypeError(f"{config.__name__}.{section_field.name} is not a section Struct")
        yield from _section(section_field.encode_name, section_type)


def _tagged_sections(name: str, members: Sequence[Any]) -> Iterator[Section]:
    """A section that is a tagged union (``[task]``, one Struct per task.kind): the keys
    every member has, under the tag key and its choices, then each member's own keys."""
    base = members[0].cls.__mro__[1]  # the Struct every member extends
    shared = msgspec.inspect.type_info(base)
    tag_field = members[0].tag_field
    tags = [member.tag for member in members]
    tag = Key(section=name, name=tag_field, type=" | ".join(_toml(t) for t in tags),
              default=_toml(tags[0]), doc=f"Which {name} section this is: one of the "
              f"{name}.{tag_field} sections below, whose keys only it takes.")
    common, *nested = _section(name, shared)
    yield Section(name, common.doc, (tag, *common.keys))
    yield from nested
    for member in members:
        hints = typing.get_type_hints(member.cls, include_extras=True)
        docs = field_docs(member.cls)
        keys = tuple(Key(section=name, name=field.encode_name, type=render_type(hints[field.name]),
                         default=_default(field), doc=docs.get(field.name, ""))
                     for field in member.fields if field.name not in base.__struct_fields__)
        yield Section(name, inspect.cleandoc(member.cls.__doc__ or ""), keys,
                      title=f"[{name}] with {tag_field} = {_toml(member.tag)}")


def _section(name: str, section_type: msgspec.inspect.StructType) -> Iterator[Section]:
    """The section ``name`` and, after it, each table nested in it (``[task.environment]``)."""
    cls = section_type.cls
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    keys = tuple(
        Key(section=name, name=field.encode_name, type=render_type(hints[field.name]),
            default=_default(field), doc=docs.get(field.name, ""))
        for field in section_type.fields
    )
    yield Section(name, inspect.cleandoc(cls.__doc__ or ""), keys)
    for field in section_type.fields:
        if isinstance(field.type, msgspec.inspect.StructType):
            yield from _section(f"{name}.{field.encode_name}", field.type)


_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)


def _prose(text: str) -> str:
    """A docstring as one markdown line: lines joined with spaces, paragraphs with <br>."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip())]
    return "<br><br>".join(p for p in paragraphs if p)


def _cell(text: str) -> str:
    """Markdown table-cell text: ``|`` escaped everywhere, ``*`` and ``<`` outside code."""
    out: list[str] = []
    last = 0
    for match in _CODE_SPAN.finditer(text):
        out.append(_escape_prose(text[last:match.start()]))
        out.append(match.group(0))
        last = match.end()
    out.append(_escape_prose(text[last:]))
    return "".join(out).replace("|", "\\|")


def _escape_prose(text: str) -> str:
    text = text.replace("*", "\\*")
    # Keep the <br> this script writes; any other "<x" would read as an HTML tag.
    return re.sub(r"<(?!br>)(?=[A-Za-z/!?])", "&lt;", text)


def render(config: type[msgspec.Struct] | None = None) -> str:
    """The whole markdown page for ``config`` (default: the run's ``Config``)."""
    lines = [
        "# Configuration reference",
        "",
        f"Generated from the config's field docstrings by `python scripts/config_docs.py >"
        f" docs/config.md` (or `{COMMAND}`); set a key in a TOML config file under its"
        " `[section]` table (`key = value`), or on the command line with"
        " `--set section.key=value`.",
    ]
    for section in sections(config):
        lines += ["", f"## {section.title or f'[{section.name}]'}", ""]
        if section.doc:
            lines += [_prose(section.doc), ""]
        if not section.keys:
            lines += ["No keys besides those of every kind."]
            continue
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for key in section.keys:
            default = key.default if key.default == "required" else f"`{key.default}`"
            cells = [f"`{key.full}`", f"`{key.type}`", default, _prose(key.doc)]
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {DOCS_PATH.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true",
                      help=f"exit 1 if {DOCS_PATH.relative_to(ROOT)} is out of date")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        DOCS_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOCS_PATH.write_text(page)
    elif args.check:
        current = DOCS_PATH.read_text() if DOCS_PATH.exists() else None
        if current != page:
            print(f"{DOCS_PATH.relative_to(ROOT)} is out of date: run {COMMAND}",
                  file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
