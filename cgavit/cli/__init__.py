"""The ``cgavit`` command: one entry point over the library.

Every parser and every ``args -> typed call`` step lives in this package, one module per command
group; the library never sees argparse. Each module listed in :data:`COMMANDS` provides
``register(subparsers)``, adding parsers whose ``func`` default takes the parsed namespace and
returns an exit code.

Command modules are imported by name in :func:`build_parser`, the one place that imports them
lazily: a group whose optional extra is not installed (say ``cgavit[detect]``) is still listed, and
running it says which extra to install instead of failing the whole command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..io import CheckpointError, WriteError

#: What a user can act on: one line, exit 2, no traceback (``--debug`` shows it). Anything else is a
#: bug in cgavit and keeps its traceback.
USER_ERRORS = (ValueError, CheckpointError, WriteError, FileNotFoundError, PermissionError, IsADirectoryError, MemoryError)

#: (module, extra that provides its dependencies, sub-commands it registers)
COMMANDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("cgavit.cli.info", "", ("info",)),
    ("cgavit.cli.train", "train", ("train", "eval", "predict", "demo")),
    ("cgavit.cli.explore", "explorer", ("explore",)),
    ("cgavit.cli.analyze", "train", ("analyze",)),
    ("cgavit.cli.ablate", "train", ("ablate",)),
    ("cgavit.cli.detect", "detect", ("detect",)),
    ("cgavit.cli.bench", "bench", ("bench",)),
    ("cgavit.cli.export", "deploy", ("export",)),
    ("cgavit.cli.quantize", "deploy", ("quantize",)),
    ("cgavit.cli.roofline", "", ("roofline",)),
)


def _missing_extra(module: str, extra: str, err: ImportError):
    def run(args: argparse.Namespace) -> int:
        raise ValueError(
            f"this command needs {err.name or 'a package'} ({err}); install it with "
            f"pip install 'cgavit[{extra or 'all'}]'"
        )

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cgavit",
        description="EfficientViT with cascaded group attention: models, training, speed, analyses.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help="show the full traceback when a command fails")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module, extra, names in COMMANDS:
        try:
            importlib.import_module(module).register(sub)
        except ImportError as err:
            if (err.name or "").startswith("cgavit"):
                raise  # our own module is broken: that is a bug, not a missing extra
            for name in names:
                p = sub.add_parser(name, help=f"(needs pip install 'cgavit[{extra or 'all'}]')", add_help=False)
                p.set_defaults(func=_missing_extra(module, extra, err))
    for p in _all_subparsers(sub):  # --debug also after the command name
        if "--debug" not in p._option_string_actions:
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _all_subparsers(sub: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    out = []
    for p in dict.fromkeys(sub.choices.values()):
        out.append(p)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                out += _all_subparsers(action)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as err:
        if args.debug:
            raise
        print(f"cgavit {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"cgavit {args.command}: interrupted", file=sys.stderr)
        return 130


def _one_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
