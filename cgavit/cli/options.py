"""Command-line options generated from a config dataclass, in the manner of Hugging Face's
``HfArgumentParser``: the dataclass says what each option means and what it defaults to (its fields
are made with :func:`cgavit.fields.option`); a command only says which fields it offers, and where.

Each field becomes one option:

- flag: ``--field-name`` (``batch_size`` is ``--batch-size``), or the ``flags`` in its metadata (other
  spellings such as ``("--workers", "-j")``, or a name without dashes for a positional);
- type from the annotation: ``int``, ``float``, ``str``; ``X | None`` is ``X``; ``tuple[float, float]``
  takes two values and ``tuple[int, ...]`` one or more (``nargs`` in the metadata overrides), or one
  argument split at ``sep`` (``--embed-dim 16,32,48``);
- a ``bool`` that defaults to False is a switch (``--strict``); one that defaults to True or None is
  ``--x/--no-x``; ``action="store_false"`` makes a switch that turns a True field off;
- help: the metadata ``help``, then the dataclass default, ``(default: 224)`` (``on``/``off`` for
  ``--x/--no-x``; nothing for None, an empty value, switches, or ``show_default=False``);
- no default: a required option.

Fields whose command-line spelling is not their Python value (a dict given as ``KEY=VALUE`` strings,
the design dials) are added by the command itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, fields
from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints


def add_options(parser: Any, config: type, names: Sequence[str] | None = None, *, exclude: Sequence[str] = (),
                suppress: bool = False) -> tuple[str, ...]:
    """Add an option for each of the fields ``names`` of the dataclass ``config``.

    Args:
        parser: an ``argparse.ArgumentParser`` or one of its argument groups.
        config: the config dataclass; each field added needs ``help`` in its metadata.
        names: the fields, in the order ``--help`` lists them (default: every field but ``exclude``,
            in field order).
        exclude: fields left out when ``names`` is not given.
        suppress: options not given stay out of the namespace (``argparse.SUPPRESS`` defaults), so
            the ones a user typed can be told apart; ``--help`` still shows the dataclass defaults.

    Returns:
        The field names added: the attributes :func:`option_values` reads back.

    Raises:
        TypeError: a field without help text, or of a type that has no command-line spelling here.
    """
    hints = get_type_hints(config)
    by_name = {f.name: f for f in fields(config)}
    chosen = tuple(names) if names is not None else tuple(n for n in by_name if n not in exclude)
    for name in chosen:
        f = by_name[name]
        flags = f.metadata.get("flags") or ("--" + name.replace("_", "-"),)
        parser.add_argument(*flags, **_keywords(f, hints[name], suppress, positional=not flags[0].startswith("-")))
    return chosen


def option_values(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """``{field: value}`` of the fields ``names`` found in ``args`` (with ``suppress``: the ones given).
    Values are as argparse leaves them (a list for several values)."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def _keywords(f: Field, hint: Any, suppress: bool, positional: bool = False) -> dict[str, Any]:
    """The ``add_argument`` keywords of the field ``f`` whose resolved annotation is ``hint``."""
    meta = f.metadata
    if "help" not in meta:
        raise TypeError(f"field {f.name} has no help text: declare it with cgavit.fields.option(default, help)")
    default = f.default if f.default is not MISSING else (f.default_factory() if f.default_factory is not MISSING else MISSING)
    kind = _without_none(hint)
    kw: dict[str, Any] = {} if positional else {"dest": f.name}
    if kind is bool:
        kw["action"] = meta.get("action") or ("store_true" if default is False else argparse.BooleanOptionalAction)
    else:
        kw.update(_value_keywords(f.name, kind, meta))
    kw.update({key: meta[key] for key in ("choices", "metavar", "nargs") if key in meta})
    if default is not MISSING:
        kw["default"] = argparse.SUPPRESS if suppress else default
    elif not positional:
        kw["required"] = True
    kw["help"] = meta["help"] + _shown_default(default, kw, meta)
    return kw


def _without_none(hint: Any) -> Any:
    """``X`` for ``X | None`` (and ``X`` itself otherwise)."""
    if get_origin(hint) in (Union, UnionType):
        kinds = [k for k in get_args(hint) if k is not NoneType]
        if len(kinds) == 1:
            return kinds[0]
    return hint


def _value_keywords(name: str, kind: Any, meta: Any) -> dict[str, Any]:
    """``type`` and ``nargs`` for a field of type ``kind`` (str needs no type)."""
    if get_origin(kind) is tuple:
        items = get_args(kind)
        item = items[0]
        if "sep" in meta:
            return {"type": _separated(item, meta["sep"])}
        nargs = "+" if len(items) == 2 and items[1] is Ellipsis else len(items)
        return {"nargs": nargs, **({} if item is str else {"type": item})}
    if kind in (int, float):
        return {"type": kind}
    if kind is str:
        return {}
    raise TypeError(f"field {name}: no command-line spelling for {kind}; add this option in the command itself")


def _separated(item: type, sep: str) -> Callable[[str], tuple]:
    """A ``type`` that reads ``"16,32,48"`` as ``(16, 32, 48)`` (for ``sep=","``)."""

    def parse(text: str) -> tuple:
        return tuple(item(v) for v in text.split(sep))

    parse.__name__ = f"{item.__name__} list"  # argparse: "invalid int list value: '16,a'"
    return parse


def _shown_default(default: Any, kw: dict[str, Any], meta: Any) -> str:
    """`` (default: X)`` for the help text, or "" where it would say nothing."""
    empty = default is MISSING or default is None or (isinstance(default, (str, tuple)) and not default)
    if empty or meta.get("show_default") is False or kw.get("action") in ("store_true", "store_false"):
        return ""
    if isinstance(default, bool):
        text = "on" if default else "off"
    elif isinstance(default, tuple):
        text = meta.get("sep", " ").join(map(str, default))
    else:
        text = str(default)
    return f" (default: {text})".replace("%", "%%")  # argparse formats help with %
