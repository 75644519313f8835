"""The ``cgavit`` command: one entry point over the library.

Every parser and every ``args -> typed call`` step lives in this package, one module per command
group; the library never sees argparse. Each module named in :data:`COMMAND_GROUPS` provides
``register(subparsers)``, adding parsers whose ``func`` default takes the parsed namespace and
returns an exit code.

A command group whose optional extra is not installed (say ``cgavit[detect]``) is still listed: its
import (:func:`command_modules`) fails, and a :class:`MissingExtra` stands in for it, so that running one of its
commands says which extra to install instead of failing the whole command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import signal
import sys
import threading
import warnings
from functools import partial
from pathlib import Path

from ..io import CheckpointError, WriteError, printable, printable_line, stop_notes, write_reason
from .parser import CommandParser, chosen_parsers

#: What a user can act on: one line, exit 2, no traceback (``--debug`` shows it). Anything else is a
#: bug in cgavit and keeps its traceback.
USER_ERRORS = (ValueError, CheckpointError, WriteError, FileNotFoundError, PermissionError, IsADirectoryError, MemoryError)


class Terminated(KeyboardInterrupt):
    """A SIGTERM (a job scheduler, ``kill``, ``timeout``) raised in the main thread as an interrupt, so that it
    unwinds as Ctrl-C does: temporary files and folders removed, nothing half-written. ``cgavit train``'s loop
    takes both signals itself, to save its checkpoint first."""


def _raise_terminated(command_pid: int, signum, frame) -> None:
    """The SIGTERM handler of the process ``command_pid`` that runs a command. A child a library forked from it
    (OpenVINO's telemetry) inherits the handler: it ends as it would have without it, with no traceback."""
    if os.getpid() != command_pid:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise Terminated


class PipeSafeStdout:
    """``sys.stdout`` for a command: once the reader has gone (``cgavit bench ... | head``), what is printed is
    dropped, and the command goes on to write its files and exit as it would have, instead of dying on a
    ``BrokenPipeError`` with its measurements unwritten.

    Args:
        stream: the stream it writes to (``sys.stdout``).
    """

    def __init__(self, stream) -> None:
        self.stream, self.reader_gone = stream, False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._reader_left()
            except OSError as err:  # output redirected to a full disk, or one gone read-only
                raise self._cannot_write(err) from None
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._reader_left()
            except OSError as err:
                raise self._cannot_write(err) from None

    def _cannot_write(self, err: OSError) -> WriteError:
        """The one-line error for output that cannot be written (``> results.txt`` on a full disk), instead of a
        traceback; what would still be printed is dropped, so that Python's last flush at exit fails no more."""
        self._reader_left()
        code, reason, advice = write_reason(err, os.getcwd())
        return WriteError(code, f"cannot write the command's output (standard output): {reason}; {advice}")

    def _reader_left(self) -> None:
        """Drop what is printed from now on; the stream's own descriptor goes to the null device, so Python's
        last flush at exit finds nothing to complain about either."""
        self.reader_gone = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
        except (OSError, ValueError, AttributeError):  # a stream without a descriptor (a test's capture)
            pass

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


class MissingExtra:
    """Stands in for a command module that could not be imported for want of an optional extra: it
    registers the module's commands, each of which fails with the ``pip install`` line that fixes it.

    Args:
        extra: the extra that provides the module's dependencies, e.g. ``"detect"``.
        names: the sub-commands the module registers.
        err: the import error.

    Raises:
        ImportError: ``err`` itself when it is one of our own modules that failed (a bug, not a
            missing extra).
    """

    #: The prefix of its parsers' options: a character no argument starts with, so every argument is taken as given.
    NO_OPTIONS = "\x00"

    def __init__(self, extra: str, names: tuple[str, ...], err: ImportError) -> None:
        if (err.name or "").startswith("cgavit"):
            raise err
        self.extra, self.names, self.err = extra, names, err

    def register(self, sub: argparse._SubParsersAction) -> None:
        """Add the module's commands, listed with the extra they need."""
        for name in self.names:  # whatever follows the name (options, --help) is taken, so that it says the extra
            p = sub.add_parser(name, help=f"(needs pip install 'cgavit[{self.extra}]')", add_help=False,
                               prefix_chars=MissingExtra.NO_OPTIONS)
            p.add_argument("arguments", nargs="*")
            p.set_defaults(func=self.run)

    def run(self, args: argparse.Namespace) -> int:
        """Say which extra to install (as a user error: one line, exit 2)."""
        raise ValueError(
            f"this command needs {self.err.name or 'a package'} ({self.err}); install it with "
            f"pip install 'cgavit[{self.extra}]'"
        )


#: The command groups, in the order ``cgavit --help`` lists them: module, the extra it needs (None: the core's), and
#: the commands it registers (said to need that extra when it is missing).
COMMAND_GROUPS = (
    ("info", None, ("info",)),
    ("train", "train", ("train", "eval", "predict", "demo")),
    ("explore", "explorer", ("explore",)),
    ("analyze", "train", ("analyze",)),
    ("ablate", "train", ("ablate",)),
    ("detect", "detect", ("detect",)),
    ("bench", "bench", ("bench",)),
    ("export", "deploy,train", ("export",)),  # it reads image folders: timm transforms
    ("quantize", "deploy,train", ("quantize",)),
    ("roofline", None, ("roofline",)),
)


def command_modules() -> list:
    """The command modules, imported here rather than with this package, so that a Ctrl-C while their libraries load
    (seconds) is :func:`main`'s to handle; a :class:`MissingExtra` for a group whose extra is not installed."""
    out = []
    for name, extra, names in COMMAND_GROUPS:
        try:
            out.append(importlib.import_module(f"{__name__}.{name}"))
        except ImportError as err:
            if extra is None:
                raise
            out.append(MissingExtra(extra, names, err))
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="cgavit",
        description="EfficientViT with cascaded group attention: models, training, speed, analyses.",
        epilog="New here? 'cgavit demo' trains a small model on bundled digits (no data or download needed) and "
        "prints a predict command to try on it. 'cgavit COMMAND --help' explains each command and its options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (more detail on stderr)")
    parser.add_argument("--debug", action="store_true", help="show the full traceback when a command fails")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in command_modules():
        command.register(sub)
    for p in _all_subparsers(sub):  # --debug also after the command name
        if "--debug" not in p._option_string_actions and p.prefix_chars != MissingExtra.NO_OPTIONS:
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
    try:
        parser = build_parser()  # the commands' libraries load here
    except KeyboardInterrupt:
        print("cgavit: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    args = parser.parse_args(argv)
    empty = _options_given_no_value(parser, args)
    if empty:
        print(f"cgavit {args.command}: error: argument {empty}: expected one argument, got '--'", file=sys.stderr)
        return 2
    terminal = logging.StreamHandler()
    terminal.setFormatter(_PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[terminal])
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, partial(_raise_terminated, os.getpid())) if main_thread else None
    stdout, sys.stdout = sys.stdout, PipeSafeStdout(sys.stdout)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = partial(_show_own_warning, warnings.showwarning)
            return int(args.func(args) or 0)
    except USER_ERRORS as err:
        if args.debug:
            raise
        print(f"cgavit {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # torch's allocator: a batch or image size this machine cannot hold
        if args.debug or not out_of_memory(err):
            raise
        asked = re.search(r"allocate (\d+) bytes", str(err))
        size = f"{int(asked.group(1)) / 2**30:.1f} GiB asked for at once" if asked else "the allocator refused"
        print(f"cgavit {args.command}: error: out of memory ({size}); give a smaller batch or image size",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        if args.debug:
            raise
        terminated = isinstance(err, Terminated)
        print(f"cgavit {args.command}: {'terminated' if terminated else 'interrupted'}"
              + "".join(f"; {printable_line(note)}" for note in stop_notes(err)), file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    finally:
        sys.stdout = stdout
        if old_term is not None:  # None: not the main thread, or a handler not set from Python (left alone)
            signal.signal(signal.SIGTERM, old_term)


def _options_given_no_value(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The option given ``--`` as its value (``--epochs=--``), if any: argparse (Python 3.11, at least) stores ``[]``
    for it without calling its ``type``, which the command would fail on with a ``TypeError`` traceback. Only the
    parsers of the command given are read (another command's option may share a name and take lists)."""
    for p in chosen_parsers(parser, args):
        for action in p._actions:
            if (isinstance(action, argparse._StoreAction) and action.nargs is None and action.option_strings
                    and getattr(args, action.dest, None) == []):
                return "/".join(action.option_strings)
    return None


_PACKAGE = Path(__file__).resolve().parent.parent


def out_of_memory(err: RuntimeError) -> bool:
    """Whether ``err`` is torch failing to allocate (the CPU allocator's error, or a GPU's ``OutOfMemoryError``)."""
    text = str(err)
    return type(err).__name__ == "OutOfMemoryError" or "can't allocate memory" in text or "not enough memory" in text


def _show_own_warning(shown, message, category, filename, lineno, file=None, line=None) -> None:
    """Show a warning cgavit raised (a ``RuntimeWarning`` such as an int8 file that will saturate on this CPU)
    as one log line, like the rest of the command's output; anyone else's as ``shown`` (Python's) shows it."""
    try:
        own = Path(filename).resolve().is_relative_to(_PACKAGE)
    except (OSError, ValueError):
        own = False
    if own:
        kind = "" if category in (RuntimeWarning, UserWarning) else f"{category.__name__}: "
        logging.getLogger("cgavit").warning("%s%s", kind, message)
    else:
        shown(message, category, filename, lineno, file, line)


def _one_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return printable(" ".join(text.split()))  # names from files and folders may hold escape sequences


class _PrintableFormatter(logging.Formatter):
    """Log lines for a terminal: control and formatting characters escaped (:func:`~cgavit.io.printable`), and a
    line break within a value put into a message (a file name: ``log.warning("skipped an image: %s", error)``) too,
    so that it cannot print a line of its own; a message's own line breaks are kept."""

    def format(self, record: logging.LogRecord) -> str:
        if isinstance(record.args, tuple) and record.args:
            record = logging.makeLogRecord(record.__dict__)  # a copy: other handlers get the values as they are
            record.args = tuple(printable_line(str(a)) if isinstance(a, (str, os.PathLike)) else a for a in record.args)
        return printable(super().format(record))


if __name__ == "__main__":
    sys.exit(main())
