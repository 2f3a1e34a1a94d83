"""The ``tensorfleet`` command line.

    tensorfleet launch --ps N --workers M SCRIPT [-- ARGS]
    tensorfleet ckpt ls DIR
    tensorfleet ckpt show DIR|FILE

Every flag can also come from a ``TENSORFLEET_*`` environment variable
(``TENSORFLEET_PS``, ``TENSORFLEET_WORKERS``); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from tensorfleet.errors import TensorfleetError
from tensorfleet.launch.local import launch


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"tensorfleet: error: {name}={value!r} must be an integer") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorfleet", description="Parameter-server training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("launch", help="start a local cluster of ps and worker processes running SCRIPT",
                              description="Start NUM ps and NUM worker tasks on 127.0.0.1 with free ports; each "
                                          "runs SCRIPT with its own TF_CONFIG. Arguments after '--' go to SCRIPT.")
    run.add_argument("--ps", type=_positive, default=_env_int("TENSORFLEET_PS", 1), metavar="N",
                     help="number of ps tasks (env TENSORFLEET_PS, default 1)")
    run.add_argument("--workers", type=_positive, default=_env_int("TENSORFLEET_WORKERS", 2), metavar="M",
                     help="number of worker tasks (env TENSORFLEET_WORKERS, default 2)")
    run.add_argument("script", help="the training script every task runs")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for SCRIPT (after '--')")
    ckpt = commands.add_parser("ckpt", help="list or show checkpoints")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    ckpt_commands.add_parser("ls", help="list the checkpoints of a directory").add_argument("directory")
    ckpt_commands.add_parser("show", help="variables, shapes, step and optimizer of a checkpoint").add_argument(
        "path", help="a checkpoint directory (its latest checkpoint) or one checkpoint file")
    return parser


def script_args(args: argparse.Namespace) -> list[str]:
    """The arguments meant for SCRIPT; the '--' separator is optional (argparse keeps it on some versions)."""
    return args.script_args[1:] if args.script_args[:1] == ["--"] else list(args.script_args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "launch":
        if not Path(args.script).is_file():
            print(f"tensorfleet: error: script {args.script!r} does not exist", file=sys.stderr)
            return 2
        return launch(args.script, script_args(args), num_ps=args.ps, num_workers=args.workers)
    if args.command == "ckpt":
        from tensorfleet.launch import ckpt  # only this command needs safetensors loaded
        try:
            print(ckpt.list_text(args.directory) if args.ckpt_command == "ls" else ckpt.show_text(args.path))
        except TensorfleetError as exc:
            print(f"tensorfleet: error: {exc}", file=sys.stderr)
            return 1
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
