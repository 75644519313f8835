"""The parser every ``cgavit`` command is built on: argparse's, with the closest spelling named for a mistyped
command, choice or option, and an option no command takes reported by the command it was given to."""

from __future__ import annotations

import argparse
import difflib


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, whose errors say what was meant.

    ``cgavit trian`` and ``--interpolation bicubc`` are refused with the closest choice (``did you mean 'train'?``);
    ``cgavit info --modle m0`` with the closest option of ``cgavit info`` and that command's usage, where
    argparse reports an option a sub-command does not take with the top-level usage, naming no command. Its
    sub-command parsers are of this class too (argparse builds them with the class of their parent).
    """

    def parse_args(self, args=None, namespace=None):
        args, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = chosen_parsers(self, args)[-1]
            chosen.error(f"unrecognized arguments: {' '.join(extras)}{closest_option(chosen, extras)}")
        return args

    def _check_value(self, action: argparse.Action, value) -> None:
        if action.choices is not None and value not in action.choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in action.choices], n=1)
            if close:
                choices = ", ".join(map(repr, action.choices))
                raise argparse.ArgumentError(
                    action, f"invalid choice: {value!r}; did you mean {close[0]!r}? (choose from {choices})")
        super()._check_value(action, value)


def chosen_parsers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[argparse.ArgumentParser]:
    """``parser`` and the sub-command parsers ``args`` chose under it, outermost first (``cgavit detect train``:
    the top-level parser, ``detect``'s and ``detect train``'s)."""
    chain = [parser]
    while sub := next((a for a in chain[-1]._actions if isinstance(a, argparse._SubParsersAction)), None):
        chosen = sub.choices.get(getattr(args, sub.dest, None) or "")
        if chosen is None:
            break
        chain.append(chosen)
    return chain


def closest_option(parser: argparse.ArgumentParser, words: list[str]) -> str:
    """``"; did you mean --model?"`` for the first of ``words`` that is an option close to one ``parser`` takes
    (``--modle``, ``--img_size=64``); ``""`` where none is."""
    known = [s for s, action in parser._option_string_actions.items()
             if s.startswith("--") and action.help is not argparse.SUPPRESS]
    for word in words:
        if word.startswith("-") and len(word) > 2:
            name = word.split("=", 1)[0]
            close = difflib.get_close_matches(name, known, n=1)
            if close:
                return f"; did you mean {close[0]}?"
    return ""
