"""The commands and code of the project's Markdown pages, read for the tests that run them.

A page's fenced blocks (```` ```sh ````, ```` ```python ````, ...), the cells of its tables and its headings
(with the anchors GitHub gives them); a shell line split into the commands it runs. Nothing here runs
anything: ``tests/integration/test_documented_commands.py`` decides what each command is checked with.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$")
_SPAN = re.compile(r"(`+)(.+?)\1")


@dataclass(frozen=True)
class Block:
    """A fenced block: its language (``""`` when none is given), the line of its first body line, its body."""

    language: str
    line: int
    body: str


@dataclass(frozen=True)
class Snippet:
    """One command line or one piece of code of a page, and where it is (``README.md``, line 12)."""

    page: str
    line: int
    text: str
    origin: str  # "fence" or "table"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Command:
    """One command of a shell line: its environment assignments (``TF_CONFIG=...``) and its words."""

    snippet: Snippet
    words: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    part: int = 0  # which command of a line chained with && or ;

    @property
    def program(self) -> str:
        return self.words[0] if self.words else ""

    @property
    def id(self) -> str:
        return f"{self.snippet.where}" + (f"#{self.part}" if self.part else "")


@dataclass(frozen=True)
class Heading:
    level: int
    title: str
    anchor: str
    line: int


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text``, in order."""
    return [Block(match.group(1).strip().lower(), text.count("\n", 0, match.start(2)) + 1, match.group(2))
            for match in _FENCE.finditer(text)]


def outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line that is not inside a fenced block (nor a fence itself)."""
    lines, inside = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside:
            lines.append((number, line))
    return lines


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """The logical lines of a shell block: backslash continuations and quotes left open joined, blank lines
    dropped. Each with the line it starts on."""
    logical: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for offset, line in enumerate(block.body.splitlines()):
        if not pending:
            if not line.strip():
                continue
            start = block.line + offset
        pending.append(line[:-1] if line.endswith("\\") else line)
        if line.endswith("\\"):
            continue
        joined = " ".join(part.strip() for part in pending) if len(pending) > 1 else pending[0].strip()
        try:
            shlex.split(joined, comments=True)
        except ValueError:  # a quote still open: the line goes on (TF_CONFIG='{... on two lines)
            pending = ["\n".join(pending)]
            continue
        logical.append((start, joined))
        pending = []
    if pending:
        logical.append((start, " ".join(pending)))
    return logical


def commands(snippet: Snippet) -> list[Command]:
    """The commands a shell line runs: split at ``&&``, ``||`` and ``;``, less a trailing ``&``, its output
    redirection and its comment; leading ``NAME=value`` words are the command's environment."""
    text = snippet.text[2:] if snippet.text.startswith("$ ") else snippet.text
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    parts: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";"):
            parts.append([])
        else:
            parts[-1].append(token)
    found = []
    for index, tokens in enumerate(part for part in parts if part):
        if tokens[-1] == "&":
            tokens = tokens[:-1]
        for redirect in (">", ">>", "<", "2>", "|"):
            if redirect in tokens:
                tokens = tokens[:tokens.index(redirect)]
        env = {}
        while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
            name, _, value = tokens.pop(0).partition("=")
            env[name] = value
        found.append(Command(snippet, tuple(tokens), env, index))
    return found


def table_rows(text: str) -> list[tuple[int, list[str]]]:
    """(line, cells) of every row of every table outside fenced blocks, less header and separator rows."""
    rows: list[tuple[int, list[str]]] = []
    previous = ""
    for number, line in outside_fences(text):
        stripped = line.strip()
        if stripped.startswith("|") and stripped.endswith("|"):
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", stripped[1:-1])]
            is_separator = all(re.fullmatch(r":?-{3,}:?", cell) for cell in cells)
            is_header = not previous.startswith("|")
            if not is_separator and not is_header:
                rows.append((number, [cell.replace("\\|", "|") for cell in cells]))
        previous = stripped
    return rows


def code_spans(cell: str) -> list[str]:
    """The inline code spans of a table cell or a line, in order."""
    return [match.group(2).strip() for match in _SPAN.finditer(cell)]


def github_anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(text: str) -> list[Heading]:
    """The headings outside fenced blocks, each with its anchor (a repeated one gets ``-1``, ``-2``, ...)."""
    found, seen = [], {}
    for number, line in outside_fences(text):
        match = _HEADING.match(line)
        if not match:
            continue
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.append(Heading(len(match.group(1)), match.group(2), f"{anchor}-{count}" if count else anchor, number))
    return found

