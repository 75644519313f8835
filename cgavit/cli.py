"""The ``cgavit`` command: one entry point, thin sub-commands over the library.

Each feature area registers its sub-commands from its own module: a module listed in
``_COMMAND_MODULES`` provides ``register(subparsers)``, which adds parsers whose ``func`` default
takes the parsed ``argparse.Namespace`` and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

_COMMAND_MODULES = (
    "cgavit.info",
    "cgavit.train.cli",
    "cgavit.explorer.server",
    "cgavit.analysis.cli",
    "cgavit.detection.cli",
    "cgavit.bench",
    "cgavit.deploy",
    "cgavit.analysis.roofline",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cgavit",
        description="EfficientViT with cascaded group attention: models, training, speed, analyses.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


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
    except (ValueError, FileNotFoundError) as err:
        print(f"cgavit {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
