"""The ``tensorfleet`` command line.

    tensorfleet launch [--ps N] [--workers M] [--sync|--async] [--restart on-failure|never]
                       [--max-restarts R] [--logdir DIR] [--dashboard [PORT]] [--dry-run] SCRIPT [-- ARGS]
    tensorfleet launch [flags that override the file] job.yaml|job.toml
    tensorfleet dashboard --cluster SPEC [--port PORT]
    tensorfleet ckpt ls DIR
    tensorfleet ckpt show DIR|FILE
    tensorfleet data fetch movielens [--cache DIR]
    tensorfleet serve-model CHECKPOINT_DIR --model SCRIPT [--port PORT] [--no-reload] [-- ARGS]
    tensorfleet k8s render --ps N --workers M --image IMG [options] SCRIPT [-- ARGS]

Every launch setting can also come from a ``TENSORFLEET_*`` variable
(``TENSORFLEET_WORKERS=4``, ``TENSORFLEET_MODE=sync``); a flag on the command line wins.  Wrong flags or job files
print one line saying what is wrong and exit 2, with nothing started.

The argument line has one rule: the command's own flags come before SCRIPT, the script's
after it (ideally after ``--``).  A flag of the command found after SCRIPT and before
``--`` is refused with the corrected command line, never silently handed to the
script (``launch x.py --workers 1 --dry-run`` must not start a job).  Flags are never
abbreviated (``--worker`` is not ``--workers``); an unknown one is an error naming
the valid ones.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import select
import shlex
import sys
from pathlib import Path
from importlib import metadata
from typing import Callable, Mapping, NoReturn, Sequence

from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.launch import k8s
from tensorfleet.launch.config import is_job_file, job_config
from tensorfleet.launch.supervisor import RESTART_MODES

USAGE_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program stopped by Ctrl-C
BROKEN_PIPE = 141  # 128 + SIGPIPE, what `yes | head -1` reports for yes
GRPC_VERBOSITY = "GRPC_VERBOSITY"


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (what is wrong, where to look), and no flag is abbreviated."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def flags(self) -> list[str]:
        """This parser's long flags, in the order they were added."""
        return [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]


def version() -> str:
    try:
        return metadata.version("tensorfleet")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        from tensorfleet import __version__
        return __version__


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
    if action.type is _port:
        return _INTEGER.fullmatch(following) is not None
    return not following.startswith("-")


def _bare_optional_flags(parser: argparse.ArgumentParser, tokens: Sequence[str]) -> list[str]:
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


def _add_launch_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "launch", help="start and supervise a local cluster of ps and worker processes running SCRIPT",
        usage="tensorfleet launch [FLAGS] SCRIPT|JOBFILE [-- SCRIPT_ARGS ...]",
        description="Start N ps and M worker tasks on 127.0.0.1, each running SCRIPT with its own TF_CONFIG; "
                    "restart tasks that die, show the job's progress, print a summary at the end. SCRIPT|JOBFILE "
                    "is the training script, or a YAML/TOML job file with the same fields as these flags (flags "
                    "given here override it). FLAGS go before SCRIPT|JOBFILE; SCRIPT_ARGS, after '--', go to "
                    "SCRIPT. Flags are never abbreviated. Every flag can also be set as TENSORFLEET_<FLAG>, "
                    "e.g. TENSORFLEET_WORKERS=4 or TENSORFLEET_MODE=sync.")
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
                     help="serve the live dashboard on 127.0.0.1:PORT (no PORT: a free port; PORT is taken only "
                     "when it is a number: '--dashboard train.py' runs train.py)")
    run.add_argument("--port", type=_port, metavar="P", help="task ports P, P+1, ... (default: free ports)")
    run.add_argument("--name", help="the job's name in the views (default: the script's name)")
    run.add_argument("--progress-every", dest="progress_every", type=float,
                     default=float(os.environ.get("TENSORFLEET_PROGRESS_EVERY", 10.0)),
                     metavar="S", help="when the output is not a terminal, print the progress line every S "
                     "seconds (default 10; on a terminal it stays at the bottom)")
    run.add_argument("--dry-run", dest="dry_run", action="store_true",
                     help="print the tasks, ports and environment that would start, and start nothing")
    # Optional for argparse so that a missing one is our message (main says what to give, with the usage line).
    run.add_argument("target", nargs="?", metavar="SCRIPT|JOBFILE",
                     help="the training script, or a .yaml/.toml job file")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="SCRIPT_ARGS",
                     help="arguments for SCRIPT, after '--'").required = False  # none is fine


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


def _add_serve_model_parser(commands: argparse._SubParsersAction) -> None:
    # Its code (torch, uvicorn) is imported only when the command runs: see tensorfleet.serving.server.
    serve = commands.add_parser(
        "serve-model", help="answer predictions over HTTP from a checkpoint directory, applying new checkpoints "
                            "as they land",
        description="Load the latest checkpoint of CHECKPOINT_DIR into the training script's model and answer "
                    "POST /v1/predict; every delta checkpoint the chief writes there is applied as it lands, "
                    "atomically (no restart). The script defines serving_model(argv) and predict(module, inputs).")
    serve.add_argument("directory", metavar="CHECKPOINT_DIR", help="the job's checkpoint_dir (it may not exist yet)")
    serve.add_argument("--model", required=True, metavar="SCRIPT",
                       help="the training script; it defines serving_model(argv) and predict(module, inputs)")
    serve.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1; 0.0.0.0 "
                       "exposes the predictions to the network, without authentication)")
    serve.add_argument("--port", type=_port, default=8500, help="port (default 8500; 0: a free one)")
    serve.add_argument("--poll-interval", dest="poll_interval", type=float, default=0.25, metavar="S",
                       help="how often to look for a new checkpoint, in seconds (default 0.25)")
    serve.add_argument("--no-reload", dest="follow", action="store_false",
                       help="serve the first checkpoint found and never apply a newer one")
    # The script's own flags (for serving_model) go after '--'; main() hands them over as args.script_args.


# A command added from a layer above (the job service's ``serve``, ``jobs``, ``users``): a function that
# adds its parser to the subcommands, and one that runs it and returns the exit code.
Command = tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], int]]


def build_parser(commands: Mapping[str, Command] | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="tensorfleet", description="Parameter-server training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"tensorfleet {version()}")
    extra_commands = commands
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_launch_parser(commands)
    _add_dashboard_parser(commands)
    ckpt = commands.add_parser("ckpt", help="list or show checkpoints")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    ckpt_commands.add_parser("ls", help="list the checkpoints of a directory").add_argument("directory")
    ckpt_commands.add_parser("show", help="variables, shapes, step and optimizer of a checkpoint").add_argument(
        "path", help="a checkpoint directory (its latest checkpoint) or one checkpoint file")
    ckpt_commands.add_parser("compact", help="replace the latest chain of delta checkpoints with one full "
                             "checkpoint (run it where no job is saving)").add_argument("directory")
    data = commands.add_parser("data", help="fetch the data sets that come from a package (MovieLens-100K)")
    data_commands = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    fetch = data_commands.add_parser("fetch", help="download a data set's package into the cache and verify it")
    fetch.add_argument("dataset", choices=["movielens"], help="movielens: MovieLens-100K, from the recbole wheel")
    fetch.add_argument("--cache", default=None, help="the cache folder (default: $TENSORFLEET_DATA, else "
                                                     "~/.cache/tensorfleet)")
    _add_serve_model_parser(commands)
    k8s.add_parser(commands)
    for add, _run in (extra_commands or {}).values():
        add(commands)
    return parser


def subcommand_parser(parser: argparse.ArgumentParser, *path: str) -> _Parser:
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


def script_args(parser: argparse.ArgumentParser, args: argparse.Namespace, head: Sequence[str], target: str,
                after_separator: Sequence[str]) -> list[str]:
    """The arguments meant for SCRIPT; exits 2 with the corrected command when a flag of ours follows it.

    ``head`` is the command line before any '--' (what argparse parsed), ``after_separator`` what followed it.
    """
    misplaced, extra = split_after_target(parser, args.script_args)
    extra += after_separator
    if misplaced:
        before = list(head)[:len(head) - len(args.script_args) - 1]  # the command line up to TARGET
        fixed = ["tensorfleet", *before, *misplaced, target] + (["--", *extra] if extra else [])
        flags = ", ".join(t.split("=")[0] for t in misplaced if t.startswith("-"))
        parser.error(f"{flags} after {target} would go to the script; put {parser.prog}'s flags before it: "
                     f"{shlex.join(fixed)} (script flags go after '--')")
    return extra


def _unknown_flags(parser: _Parser, extras: Sequence[str]) -> NoReturn:
    """Exit 2 naming the unknown flags, the nearest valid one, and every valid one."""
    valid = parser.flags()
    unknown = [t for t in extras if t.startswith("-")] or list(extras)
    hints = [f"{t} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(t.split("=")[0], valid, 1))
             else t for t in unknown]
    parser.error(f"unknown argument(s) {', '.join(hints)}; valid flags: {' '.join(valid)}")


def _launch(args: argparse.Namespace, extra: list[str], task_grpc_verbosity: str) -> int:
    from tensorfleet.launch.local import launch, usable_cores  # the launcher's imports: paid by this command only
    flags = {name: getattr(args, name) for name in ("ps", "workers", "gpus_per_worker", "mode", "restart",
                                                    "max_restarts", "restart_backoff", "logdir", "dashboard",
                                                    "port", "name")}
    if is_job_file(args.target):
        if extra:
            flags["args"] = extra
        config = job_config(args.target, None, flags)
    else:
        config = job_config(None, args.target, {**flags, "args": extra})
    # The tasks' gRPC errors are worth keeping: the launcher routes them to the task's log file.
    config.env.setdefault(GRPC_VERBOSITY, task_grpc_verbosity)
    _warn_if_oversubscribed(config.ps, config.workers, usable_cores())
    return launch(config, dry_run=args.dry_run, progress_every_s=args.progress_every)


def _warn_if_oversubscribed(ps: int, workers: int, cores: int) -> None:
    """Say once that a fleet far larger than the machine will be slow; it runs anyway (a test fleet on a laptop
    is a fine thing to start). Workers compute all the time, a ps mostly waits: 1 ps + 2 workers on 2 cores is
    the quickstart's fleet and runs well, so only more workers than cores, or tasks past twice the cores, warn."""
    tasks = ps + workers
    if workers > cores or tasks > 2 * cores:
        print(f"tensorfleet launch: warning: {tasks} tasks ({ps} ps + {workers} workers) on {cores} core(s): they "
              f"will share the cores and the job will be slow; starting it anyway", file=sys.stderr, flush=True)


def _dashboard(args: argparse.Namespace) -> int:
    from tensorfleet.launch.attach import serve_dashboard
    return serve_dashboard(args)


def main(argv: Sequence[str] | None = None, commands: Mapping[str, Command] | None = None) -> int:
    """Run ``tensorfleet ARGV``; ``commands`` adds commands of the layers above (see ``Command``).

    Every command ends quietly when the user stops it or stops reading: Ctrl-C is exit 130 with one line,
    a closed pipe (``tensorfleet jobs ls | head -1``) exit 141 (as if killed by SIGPIPE), never a traceback.
    """
    try:
        try:
            return _main(argv, commands)
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


def _main(argv: Sequence[str] | None, commands: Mapping[str, Command] | None) -> int:
    task_grpc_verbosity = os.environ.get(GRPC_VERBOSITY, "ERROR")
    # This process's own gRPC (the monitor's Status calls) says nothing on the console: a task that went
    # away makes its C core log "Got goaway" at error level, unprefixed, between the task lines.
    os.environ.setdefault(GRPC_VERBOSITY, "NONE")
    argv = sys.argv[1:] if argv is None else list(argv)
    # What follows the first '--' is the script's, verbatim: argparse never sees it (it would drop the '--'
    # on some paths and keep it on others).
    cut = argv.index("--") if "--" in argv else len(argv)
    head, after_separator = argv[:cut], argv[cut + 1:]
    parser = build_parser(commands)
    parsed = head
    if head[:1] == ["launch"]:  # '--dashboard train.py': the script is not the dashboard's port
        parsed = head[:1] + _bare_optional_flags(subcommand_parser(parser, "launch"), head[1:])
    args, extras = parser.parse_known_args(parsed)
    path = [args.command] + ([args.k8s_command] if args.command == "k8s" else [])
    command = subcommand_parser(parser, *path)
    if extras:
        _unknown_flags(command, extras)
    if args.command == "launch" and args.target is None:
        command.error(f"a SCRIPT or a job file (job.yaml / job.toml) is needed; usage: {command.usage}")
    try:
        if commands and args.command in commands:
            return commands[args.command][1](args)
        if args.command == "launch":
            return _launch(args, script_args(command, args, head, args.target, after_separator), task_grpc_verbosity)
        if args.command == "dashboard":
            return _dashboard(args)
        if args.command == "serve-model":
            from tensorfleet.serving.server import main as serve_model
            args.script_args = after_separator
            return serve_model(args)
        if args.command == "k8s":
            args.script_args = script_args(command, args, head, args.script, after_separator)
            return k8s.main(args)
        if args.command == "ckpt":
            from tensorfleet.launch import ckpt  # only this command needs safetensors loaded
            if args.ckpt_command == "compact":
                print(ckpt.compact(args.directory))
            else:
                print(ckpt.list_text(args.directory) if args.ckpt_command == "ls" else ckpt.show_text(args.path))
            return 0
        if args.command == "data":
            from tensorfleet.data import movielens
            wheel = movielens.fetch(Path(args.cache) if args.cache else None)
            ratings = len(movielens.load(wheel.parent))
            print(f"MovieLens-100K: {ratings} ratings, verified, in {wheel}")
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
