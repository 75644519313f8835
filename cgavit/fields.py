"""Config fields that carry their own documentation, for the dataclasses the commands are built from.

``option(default, help, ...)`` is a :func:`dataclasses.field` whose ``metadata`` holds the field's one
text (``help``) and, as plain data, how the command line spells it. The library reads none of it;
:mod:`cgavit.cli.options` turns each field into an ``argparse`` option, in the manner of Hugging
Face's ``HfArgumentParser``, so a default and a help text are written once, beside the field::

    @dataclass
    class RunConfig:
        workers: int = option(4, "data-loading worker processes", flags=("--workers", "-j"))
"""

from __future__ import annotations

from dataclasses import MISSING, Field, field
from typing import Any

#: The metadata an option may carry besides ``help`` (see :mod:`cgavit.cli.options` for their meaning).
SPELLING_KEYS = frozenset({"flags", "choices", "metavar", "nargs", "sep", "action", "show_default"})


def option(default: Any = MISSING, help: str = "", **spelling: Any) -> Field:
    """A dataclass field documented by ``help``, the text its command-line option shows.

    Args:
        default: the default value (an immutable one); leave it out for a required field.
        help: what the field means, in a phrase: the field's documentation and its ``--help`` line.
        **spelling: how the command line writes it, as plain data: ``flags`` (option strings, e.g.
            ``("--workers", "-j")``, or a positional name), ``choices``, ``metavar``, ``nargs``,
            ``sep`` (one argument whose values are separated by it, e.g. ``","`` for ``16,32,48``),
            ``action`` (``"store_false"``: a switch that turns a True field off) and
            ``show_default`` (False: ``--help`` does not name the default).

    Returns:
        The field, for a dataclass body.

    Raises:
        TypeError: no help text, or a spelling key not listed above.
    """
    unknown = set(spelling) - SPELLING_KEYS
    if unknown or not help:
        raise TypeError(f"option() needs help text and knows {', '.join(sorted(SPELLING_KEYS))}; got {sorted(unknown)}")
    return field(default=default, metadata={"help": help, **spelling})
