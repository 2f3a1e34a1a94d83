"""What every ``tensorfleet`` command parses alike: one-line errors, never an abbreviated flag, counts and ports,
and the rule that a command's flags come before its SCRIPT and the script's after it."""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
from dataclasses import dataclass
from typing import Callable, NamedTuple, NoReturn, Sequence

USAGE_ERROR = 2


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (what is wrong, where to look), and no flag is abbreviated."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def flags(self) -> list[str]:
        """This parser's long flags, in the order they were added."""
        return [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]


def integer_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``, or a one-line error saying so."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value
    return convert


positive_int, non_negative_int = integer_at_least(1), integer_at_least(0)


def port_number(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0..65535; 0 picks a free one)")
    return value


_INTEGER = re.compile(r"[-+]?\d+")


def _takes_value(action: argparse.Action, following: str | None) -> bool:
    """Whether ``action`` (a flag not written as ``--flag=VALUE``) takes the token after it as its value.

    An optional port (``--dashboard [PORT]``) takes it only when it is a number: in
    ``--dashboard train.py`` the script stays the script.
    """
    if action.nargs == 0:
        return False
    if action.nargs != "?":
        return True
    if following is None:
        return False
    if action.type is port_number:
        return _INTEGER.fullmatch(following) is not None
    return not following.startswith("-")


def bare_optional_flags(parser: argparse.ArgumentParser, tokens: Sequence[str]) -> list[str]:
    """``tokens`` (a command's own, before its SCRIPT) with each optional port that takes no value written
    ``--flag=CONST``, so that argparse (which would take any next token) does not take the script."""
    tokens = list(tokens)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("-"):
            break  # SCRIPT: what follows is the script's, or misplaced flags (script_args says which)
        action = parser._option_string_actions.get(token.split("=", 1)[0])
        if action is None or "=" in token:
            i += 1
            continue
        takes = _takes_value(action, tokens[i + 1] if i + 1 < len(tokens) else None)
        if action.nargs == "?" and not takes:
            tokens[i] = f"{token}={action.const}"
        i += 2 if takes else 1
    return tokens


def subcommand_parser(parser: argparse.ArgumentParser, *path: str) -> Parser:
    """The parser of ``tensorfleet PATH...``, e.g. ``subcommand_parser(parser, "k8s", "render")``."""
    for name in path:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = subparsers.choices[name]
    return parser  # type: ignore[return-value]


def split_after_target(parser: argparse.ArgumentParser, tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split what followed SCRIPT (up to '--') into (flags of ``parser``, with their values; the script's)."""
    misplaced: list[str] = []
    script: list[str] = []
    tokens = list(tokens)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        action = parser._option_string_actions.get(token.split("=", 1)[0]) if token.startswith("-") else None
        if action is None or isinstance(action, argparse._HelpAction):
            script.append(token)
            i += 1
            continue
        following = tokens[i + 1] if i + 1 < len(tokens) else None
        takes = 0 if "=" in token or not _takes_value(action, following) else 1
        misplaced += tokens[i:i + 1 + takes]
        i += 1 + takes
    return misplaced, script


def unknown_flags(parser: Parser, extras: Sequence[str]) -> NoReturn:
    """Exit 2 naming the unknown flags, the nearest valid one, and every valid one."""
    valid = parser.flags()
    unknown = [t for t in extras if t.startswith("-")] or list(extras)
    hints = [f"{t} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(t.split("=")[0], valid, 1))
             else t for t in unknown]
    parser.error(f"unknown argument(s) {', '.join(hints)}; valid flags: {' '.join(valid)}")


@dataclass(frozen=True)
class CommandLine:
    """The command line around a command's parsed flags: what a command that runs a script needs besides them."""

    parser: Parser               # the command's own parser: its errors name the command
    head: list[str]              # the command line before the first '--' (what argparse parsed)
    after_separator: list[str]   # what followed the first '--', verbatim: the script's
    task_grpc_verbosity: str     # the user's GRPC_VERBOSITY (this process silences its own gRPC), for the tasks

    def script_args(self, args: argparse.Namespace, target: str) -> list[str]:
        """The arguments meant for SCRIPT (``target``); exits 2 with the corrected command when a flag of ours
        follows it."""
        misplaced, extra = split_after_target(self.parser, args.script_args)
        extra += self.after_separator
        if misplaced:
            head = self.head
            before = head[:len(head) - len(args.script_args) - 1]  # the command line up to TARGET
            fixed = ["tensorfleet", *before, *misplaced, target] + (["--", *extra] if extra else [])
            flags = ", ".join(t.split("=")[0] for t in misplaced if t.startswith("-"))
            self.parser.error(f"{flags} after {target} would go to the script; put {self.parser.prog}'s flags "
                              f"before it: {shlex.join(fixed)} (script flags go after '--')")
        return extra


class Command(NamedTuple):
    """One ``tensorfleet`` command: adds its parser to the subcommands, and runs it (the exit code)."""

    add: Callable[[argparse._SubParsersAction], None]
    run: Callable[[argparse.Namespace, CommandLine], int]
