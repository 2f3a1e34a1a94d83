"""The ``tensorfleet`` command line.

    tensorfleet launch [--ps N] [--workers M] [--sync|--async] [--restart on-failure|never]
                       [--max-restarts R] [--logdir DIR] [--dashboard [PORT]] [--dry-run] SCRIPT [-- ARGS]
    tensorfleet launch job.yaml|job.toml [flags that override the file]
    tensorfleet dashboard --cluster SPEC [--port PORT]
    tensorfleet ckpt ls DIR
    tensorfleet ckpt show DIR|FILE
    tensorfleet k8s render --ps N --workers M --image IMG [options] SCRIPT [-- ARGS]

Every launch setting can also come from a ``TENSORFLEET_*`` variable
(``TENSORFLEET_WORKERS=4``, ``TENSORFLEET_MODE=sync``); a flag on the command line wins.  Wrong flags or job files
print one line saying what is wrong and exit 2, with nothing started.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn, Sequence

from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.launch import k8s
from tensorfleet.launch.config import is_job_file, job_config
from tensorfleet.launch.supervisor import RESTART_MODES

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (what is wrong, where to look), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _integer(minimum: int) -> Callable[[str], int]:
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


_positive, _non_negative = _integer(1), _integer(0)


def _port(text: str) -> int:
    value = _non_negative(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0..65535; 0 picks a free one)")
    return value


def _add_launch_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "launch", help="start and supervise a local cluster of ps and worker processes running SCRIPT",
        description="Start N ps and M worker tasks on 127.0.0.1, each running SCRIPT with its own TF_CONFIG; "
                    "restart tasks that die, show the job's progress, print a summary at the end. TARGET is "
                    "the training script, or a YAML/TOML job file with the same fields as these flags (flags "
                    "given here override it). Arguments after '--' go to SCRIPT. Every flag can also be set "
                    "as TENSORFLEET_<FLAG>, e.g. TENSORFLEET_WORKERS=4 or TENSORFLEET_MODE=sync.")
    # Defaults are None so that a job file's values show through; JobConfig holds the real defaults.
    run.add_argument("--ps", type=_positive, metavar="N", help="number of ps tasks (env TENSORFLEET_PS; default 1)")
    run.add_argument("--workers", type=_positive, metavar="M",
                     help="number of worker tasks (env TENSORFLEET_WORKERS; default 2)")
    run.add_argument("--gpus-per-worker", dest="gpus_per_worker", type=_non_negative,
                     metavar="K", help="GPUs each worker gets (CUDA_VISIBLE_DEVICES); ps stay on CPU (default 0)")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--sync", dest="mode", action="store_const", const="sync",
                      help="synchronous training (sets TENSORFLEET_MODE for the script's --sync/--async default)")
    mode.add_argument("--async", dest="mode", action="store_const", const="async", help="asynchronous training")
    run.add_argument("--restart", choices=RESTART_MODES, help="restart a task that exits abnormally (default "
                     "on-failure), with exponential backoff")
    run.add_argument("--max-restarts", dest="max_restarts", type=_non_negative, metavar="R",
                     help="give up on a task after R restarts (default 3)")
    run.add_argument("--restart-backoff", dest="restart_backoff", type=float, metavar="S",
                     help="seconds before a task's first restart, doubling with each one up to 30 (default 1)")
    run.add_argument("--logdir", metavar="DIR", help="per-task log files and events.jsonl (default: a new "
                     "temporary directory, printed at the end)")
    run.add_argument("--dashboard", type=_port, nargs="?", const=0, metavar="PORT",
                     help="serve the live dashboard on 127.0.0.1:PORT (no PORT: a free port)")
    run.add_argument("--port", type=_port, metavar="P", help="task ports P, P+1, ... (default: free ports)")
    run.add_argument("--name", help="the job's name in the views (default: the script's name)")
    run.add_argument("--progress-every", dest="progress_every", type=float,
                     default=float(os.environ.get("TENSORFLEET_PROGRESS_EVERY", 10.0)),
                     metavar="S", help="when the output is not a terminal, print the progress line every S "
                     "seconds (default 10; on a terminal it stays at the bottom)")
    run.add_argument("--dry-run", dest="dry_run", action="store_true",
                     help="print the tasks, ports and environment that would start, and start nothing")
    run.add_argument("target", metavar="SCRIPT|JOBFILE", help="the training script, or a .yaml/.toml job file")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for SCRIPT (after '--')")


def _add_dashboard_parser(commands: argparse._SubParsersAction) -> None:
    board = commands.add_parser(
        "dashboard", help="serve the live dashboard of a running fleet",
        description="Attach to a running fleet and serve its live dashboard and /metrics. The fleet is given "
                    "as --cluster (JSON or a JSON file), as --ps_hosts/--worker_hosts, or by TF_CONFIG.")
    board.add_argument("--cluster", help='the cluster, e.g. \'{"ps": ["host:2222"], "worker": ["host:2223"]}\', '
                       "or a file holding it")
    board.add_argument("--ps_hosts", help="comma-separated host:port list")
    board.add_argument("--worker_hosts", help="comma-separated host:port list")
    board.add_argument("--port", type=_port, default=0, help="port to serve on (default: a free port)")
    board.add_argument("--host", default="127.0.0.1",
                       help="address to serve on (default 127.0.0.1; 0.0.0.0 exposes it to the network)")
    board.add_argument("--name", default="fleet", help="the job's name on the page")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tensorfleet", description="Parameter-server training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_launch_parser(commands)
    _add_dashboard_parser(commands)
    ckpt = commands.add_parser("ckpt", help="list or show checkpoints")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    ckpt_commands.add_parser("ls", help="list the checkpoints of a directory").add_argument("directory")
    ckpt_commands.add_parser("show", help="variables, shapes, step and optimizer of a checkpoint").add_argument(
        "path", help="a checkpoint directory (its latest checkpoint) or one checkpoint file")
    k8s.add_parser(commands)
    return parser


def script_args(args: argparse.Namespace) -> list[str]:
    """The arguments meant for SCRIPT; the '--' separator is optional (argparse keeps it on some versions)."""
    return args.script_args[1:] if args.script_args[:1] == ["--"] else list(args.script_args)


def _launch(args: argparse.Namespace) -> int:
    from tensorfleet.launch.local import launch  # the launcher's imports are only paid for by this command
    flags = {name: getattr(args, name) for name in ("ps", "workers", "gpus_per_worker", "mode", "restart",
                                                    "max_restarts", "restart_backoff", "logdir", "dashboard",
                                                    "port", "name")}
    extra = script_args(args)
    if is_job_file(args.target):
        if extra:
            flags["args"] = extra
        config = job_config(args.target, None, flags)
    else:
        config = job_config(None, args.target, {**flags, "args": extra})
    return launch(config, dry_run=args.dry_run, progress_every_s=args.progress_every)


def _dashboard(args: argparse.Namespace) -> int:
    from tensorfleet.launch.attach import serve_dashboard
    return serve_dashboard(args)


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # not gRPC's info lines about tasks that went away
    args = build_parser().parse_args(argv)
    try:
        if args.command == "launch":
            return _launch(args)
        if args.command == "dashboard":
            return _dashboard(args)
        if args.command == "k8s":
            return k8s.main(args)
        if args.command == "ckpt":
            from tensorfleet.launch import ckpt  # only this command needs safetensors loaded
            print(ckpt.list_text(args.directory) if args.ckpt_command == "ls" else ckpt.show_text(args.path))
            return 0
    except ConfigError as exc:
        print(f"tensorfleet {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except TensorfleetError as exc:
        print(f"tensorfleet {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
