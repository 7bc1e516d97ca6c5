"""Command-line options generated from settings dataclasses: one field, one flag.

Every settings dataclass (``EngineArgs``, the server's ``ServerSettings`` / ``LaunchSettings``,
the benchmarks' configs) declares each knob once, as a field made with ``arg``: its default,
its help text and, where the flag is not simply ``--field-name``, its spelling and argparse
details. ``add_cli_args`` turns a class's fields into options of a parser and
``from_cli_args`` builds the instance back from the parsed namespace, so no flag is written
twice and no default can drift between a command line and the code.

Standard library only: ``kvserve --help`` builds its parsers from these classes without
importing torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

_NO_DEFAULT = object()


def arg(default: Any, help: str, *, flags: tuple[str, ...] = (), cli: bool = True,
        group: str | None = None, cli_default: Any = _NO_DEFAULT,
        parse: Callable[[Any], Any] | None = None, **argparse_kw: Any) -> Any:
    """A dataclass field with its command-line option.

    ``flags``: the option strings (default ``--field-name``); ``group``: an argparse group
    title; ``cli_default``: the option's default when it differs from the field's (a value, or
    a zero-argument callable read when the parser is built, e.g. an environment variable);
    ``parse``: turns the option's value into the field's (e.g. a comma list into a list);
    any other keyword goes to ``add_argument`` (``type``, ``choices``, ``action``, ``metavar``).
    ``cli=False`` keeps the field off the command line. A ``list`` / ``dict`` default is
    given through ``default_factory`` semantics (each instance gets its own copy).
    """
    meta = {"help": help, "flags": flags, "cli": cli, "group": group,
            "cli_default": cli_default, "parse": parse, "kw": argparse_kw}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _cli_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", False)]


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise AssertionError(f"CLI field {f.name} has no default")


def add_cli_args(parser: argparse.ArgumentParser, cls: type, *, skip: Collection[str] = (),
                 overrides: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """One option per CLI field of ``cls`` (dest = the field name), except those in ``skip``.

    ``overrides`` maps a field name to ``add_argument`` keywords that replace the field's own
    for this parser (``default``, ``help``, ``choices``, ``type``...): one command that reads
    a knob differently, e.g. a benchmark sweeping a comma list where the engine takes one
    value.
    """
    overrides = overrides or {}
    unknown = set(overrides) - {f.name for f in _cli_fields(cls)}
    assert not unknown, f"overrides of fields {cls.__name__} does not have: {sorted(unknown)}"
    groups: dict[str, Any] = {}
    for f in _cli_fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        target: Any = parser
        if meta["group"] is not None:
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_argument_group(meta["group"])
            target = groups[meta["group"]]
        default = meta["cli_default"]
        if default is _NO_DEFAULT:
            default = _field_default(f)
        elif callable(default):
            default = default()
        kw = {"default": default, "help": meta["help"], **meta["kw"], **overrides.get(f.name, {})}
        flags = meta["flags"] or ("--" + f.name.replace("_", "-"),)
        target.add_argument(*flags, dest=f.name, **kw)


def cli_values(cls: type, ns: argparse.Namespace, *,
               skip: Collection[str] = ()) -> dict[str, Any]:
    """The CLI fields of ``cls`` found in ``ns`` (except ``skip``), each through its ``parse``."""
    out = {}
    for f in _cli_fields(cls):
        if f.name in skip or not hasattr(ns, f.name):
            continue
        value = getattr(ns, f.name)
        parse = f.metadata["parse"]
        out[f.name] = parse(value) if parse is not None and value is not None else value
    return out


def from_cli_args(cls: type, ns: argparse.Namespace, *, skip: Collection[str] = (),
                  **fields: Any) -> Any:
    """``cls`` from a parsed command line: its CLI fields from ``ns`` (fields absent from
    ``ns`` or named in ``skip`` keep their defaults), then ``fields`` on top."""
    return cls(**{**cli_values(cls, ns, skip=skip), **fields})


def parse_list(value: Any, conv: Callable[[str], Any], name: str) -> list:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (order kept, duplicates dropped; a list passes through
    deduplicated); errors are ``ValueError``s naming the option."""
    if not isinstance(value, str):
        return list(dict.fromkeys(value))
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ValueError(f"{name} must be a comma-separated list, got {value!r}")
    try:
        out = [conv(v) for v in items]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: cannot parse {value!r} ({e})") from None
    return list(dict.fromkeys(out))


def parse_positive_ints(value: Any, name: str) -> list[int]:
    out = parse_list(value, int, name)
    if any(v < 1 for v in out):
        raise ValueError(f"{name} must be positive integers, got {value!r}")
    return out
