"""Command-line flags derived from a configuration dataclass, so each default and help text is written once.

A field declared with `flag(default, help, ...)` becomes `--field-name` (or the names given), typed from
its annotation; `add_flags` adds a dataclass's flags to a parser and `from_args` builds the dataclass back
from the parsed namespace. Fields without `flag` metadata are not on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .sizes import SizeError, parse_size

_KEY = "tenplex.flag"


def flag(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    names: tuple[str, ...] = (),
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    cli_default: Any = dataclasses.MISSING,
    **argparse_kw: Any,
) -> Any:
    """A dataclass field that is also a flag: `names` (default `--field-name`, aliases after it; a name
    without dashes makes a positional), any `add_argument` keyword (`choices`, `action`, `metavar`, `type`,
    `dest`), and `cli_default`: what the command line holds when the flag is not given, if not the
    field's default (e.g. None: "not given", which the command resolves)."""
    if cli_default is not dataclasses.MISSING:
        argparse_kw["default"] = cli_default
    meta = {_KEY: {"help": help, "names": names, "kw": argparse_kw}}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def size(text: str) -> int:
    """argparse type for byte sizes (`512MiB`): a bad one is a usage error, one line."""
    try:
        return parse_size(text)
    except SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def flagged(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if _KEY in f.metadata]


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _typed(hint: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """`type=` (or `action=` for a bool) from the field's annotation, unless the flag says its own."""
    if "type" in kw or "action" in kw or kw.get("nargs") == argparse.REMAINDER:
        return kw
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        return {"action": "store_true", **kw}
    if hint in (int, float):
        return {"type": hint, **kw}
    return kw


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add the flags of dataclass `cls` (those in `only`, less `exclude`) to `parser`; `defaults` replaces
    fields' defaults for this command (its `--help` then shows the value it uses)."""
    hints = typing.get_type_hints(cls)
    wanted = None if only is None else set(only)
    skip, defaults = set(exclude), defaults or {}
    for f in flagged(cls):
        if (wanted is not None and f.name not in wanted) or f.name in skip:
            continue
        meta = f.metadata[_KEY]
        names = meta["names"] or (f"--{f.name.replace('_', '-')}",)
        kw = _typed(hints[f.name], {"default": defaults.get(f.name, _default(f)), **meta["kw"]})
        if names[0].startswith("-"):
            kw["dest"] = _dest(f)
        else:  # a positional: argparse takes its dest from its name, and it is given (or empty)
            assert names == (f.name,), f"{cls.__name__}.{f.name}: a positional is named as its field"
            kw.pop("default")
        parser.add_argument(*names, help=meta["help"], **kw)


def _dest(f: dataclasses.Field) -> str:
    """Where the parsed value lands: the field's name, unless the flag keeps an older one (`dest=`)."""
    return f.metadata[_KEY]["kw"].get("dest", f.name)


def from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """`cls` from the parsed flags it declares; `given` sets the fields a command converts itself (a
    path read into a schedule, a spec split into parts) and those not on the command line."""
    values = {f.name: getattr(args, _dest(f)) for f in flagged(cls) if hasattr(args, _dest(f))}
    return cls(**{**values, **given})
