"""The ``tensorfleet`` command line (``python -m tensorfleet.cli``): the fleet's commands and the job service's.

    tensorfleet launch|dashboard|ckpt|data|serve-model|k8s ...   run, watch, checkpoint, serve a fleet (fleet.py)
    tensorfleet serve|jobs|users ...                             the job service (service.py)

It sits above ``launch`` and ``service`` (neither imports it), so one program holds both. Wrong flags or
job files print one line saying what is wrong and exit 2, with nothing started.

The argument line has one rule: the command's own flags come before SCRIPT, the script's
after it (ideally after ``--``).  A flag of the command found after SCRIPT and before
``--`` is refused with the corrected command line, never silently handed to the
script (``launch x.py --workers 1 --dry-run`` must not start a job).  Flags are never
abbreviated (``--worker`` is not ``--workers``); an unknown one is an error naming
the valid ones.
"""

from __future__ import annotations

import os
import select
import sys
from importlib import metadata
from typing import Sequence

from tensorfleet.cli import fleet, service
from tensorfleet.cli.parsing import (USAGE_ERROR, Command, CommandLine, Parser, bare_optional_flags,
                                     subcommand_parser, unknown_flags)
from tensorfleet.errors import ConfigError, TensorfleetError

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program stopped by Ctrl-C
BROKEN_PIPE = 141  # 128 + SIGPIPE, what `yes | head -1` reports for yes
GRPC_VERBOSITY = fleet.GRPC_VERBOSITY

COMMANDS: dict[str, Command] = {**fleet.COMMANDS, **service.COMMANDS}  # in the order --help lists them


def version() -> str:
    try:
        return metadata.version("tensorfleet")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        from tensorfleet import __version__
        return __version__


def build_parser() -> Parser:
    parser = Parser(prog="tensorfleet", description="Parameter-server training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"tensorfleet {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tensorfleet ARGV``.

    Every command ends quietly when the user stops it or stops reading: Ctrl-C is exit 130 with one line,
    a closed pipe (``tensorfleet jobs ls | head -1``) exit 141 (as if killed by SIGPIPE), never a traceback.
    """
    try:
        try:
            return _main(argv)
        finally:  # --help and usage errors too: flushed here, not at exit, a closed pipe is caught below
            sys.stdout.flush()
    except KeyboardInterrupt:
        _say_on_stderr("tensorfleet: interrupted\n")
        return INTERRUPTED
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a socket's peer went away: a real error, not the reader of our output
        # Whatever is still buffered would fail again at exit ("Exception ignored ..."): send it nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reading end is closed: poll says POLLERR for it."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):  # no real file behind sys.stdout
        return False


def _say_on_stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed too: nothing to say it on
        pass


def _main(argv: Sequence[str] | None) -> int:
    task_grpc_verbosity = os.environ.get(GRPC_VERBOSITY, "ERROR")
    # This process's own gRPC (the monitor's Status calls) says nothing on the console: a task that went
    # away makes its C core log "Got goaway" at error level, unprefixed, between the task lines.
    os.environ.setdefault(GRPC_VERBOSITY, "NONE")
    argv = sys.argv[1:] if argv is None else list(argv)
    # What follows the first '--' is the script's, verbatim: argparse never sees it (it would drop the '--'
    # on some paths and keep it on others).
    cut = argv.index("--") if "--" in argv else len(argv)
    head, after_separator = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    parsed = head
    if head[:1] == ["launch"]:  # '--dashboard train.py': the script is not the dashboard's port
        parsed = head[:1] + bare_optional_flags(subcommand_parser(parser, "launch"), head[1:])
    args, extras = parser.parse_known_args(parsed)
    path = [args.command] + ([args.k8s_command] if args.command == "k8s" else []) + \
        ([args.slurm_command] if args.command == "slurm" else [])
    command = subcommand_parser(parser, *path)
    if extras:
        unknown_flags(command, extras)
    try:
        return COMMANDS[args.command].run(args, CommandLine(command, head, after_separator, task_grpc_verbosity))
    except ConfigError as exc:
        print(f"tensorfleet {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except TensorfleetError as exc:
        print(f"tensorfleet {args.command}: error: {exc}", file=sys.stderr)
        return 1
