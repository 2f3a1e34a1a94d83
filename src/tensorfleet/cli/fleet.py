"""The commands that run, watch, checkpoint and serve a training fleet, or render it for Kubernetes.

    tensorfleet launch [--ps N] [--workers M] [--sync|--async] [--restart on-failure|never]
                       [--max-restarts R] [--logdir DIR] [--dashboard [PORT]] [--dry-run]
                       [--backend local|ray [--ray-address ADDR] [--ray-placement spread|pack]
                                            [--ray-replace-timeout S]]
                       [--backend slurm [--slurm-partition P] [--slurm-nodes N] [--slurm-time T]] SCRIPT [-- ARGS]
    tensorfleet launch [flags that override the file] job.yaml|job.toml
    tensorfleet dashboard --cluster SPEC [--port PORT]
    tensorfleet ckpt ls DIR
    tensorfleet ckpt show DIR|FILE
    tensorfleet data fetch movielens [--cache DIR]
    tensorfleet serve-model CHECKPOINT_DIR --model SCRIPT [--port PORT] [--no-reload] [-- ARGS]
    tensorfleet k8s render --ps N --workers M --image IMG [options] SCRIPT [-- ARGS]
    tensorfleet slurm render [launch flags] SCRIPT [-- ARGS] > job.sbatch

Every launch setting can also come from a ``TENSORFLEET_*`` variable (``TENSORFLEET_WORKERS=4``,
``TENSORFLEET_MODE=sync``); a flag on the command line wins. Each command imports what it runs (the
launcher, torch, uvicorn, safetensors) when it runs, so that ``tensorfleet --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tensorfleet import backends
from tensorfleet.cli.parsing import Command, CommandLine, non_negative_int, port_number, positive_int
from tensorfleet.errors import ConfigError
from tensorfleet.launch import k8s
from tensorfleet.launch.config import BACKENDS, JobConfig, is_job_file, job_config
from tensorfleet.launch.supervisor import RESTART_MODES

GRPC_VERBOSITY = "GRPC_VERBOSITY"


# ----- launch


def _add_launch(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "launch", help="start and supervise a local cluster of ps and worker processes running SCRIPT",
        usage="tensorfleet launch [FLAGS] SCRIPT|JOBFILE [-- SCRIPT_ARGS ...]",
        description="Start N ps and M worker tasks on 127.0.0.1, each running SCRIPT with its own TF_CONFIG; "
                    "restart tasks that die, show the job's progress, print a summary at the end. SCRIPT|JOBFILE "
                    "is the training script, or a YAML/TOML job file with the same fields as these flags (flags "
                    "given here override it). FLAGS go before SCRIPT|JOBFILE; SCRIPT_ARGS, after '--', go to "
                    "SCRIPT. Flags are never abbreviated. Every flag can also be set as TENSORFLEET_<FLAG>, "
                    "e.g. TENSORFLEET_WORKERS=4 or TENSORFLEET_MODE=sync. With --backend ray or slurm the tasks "
                    "run on that cluster.")
    _add_job_flags(run)


def _add_job_flags(run: argparse.ArgumentParser) -> None:
    """The flags of a job, for ``launch`` and ``slurm render``."""
    # Defaults are None so that a job file's values show through; JobConfig holds the real defaults.
    run.add_argument("--ps", type=positive_int, metavar="N", help="number of ps tasks (env TENSORFLEET_PS; default 1)")
    run.add_argument("--workers", type=positive_int, metavar="M",
                     help="number of worker tasks (env TENSORFLEET_WORKERS; default 2)")
    run.add_argument("--gpus-per-worker", dest="gpus_per_worker", type=non_negative_int,
                     metavar="K", help="GPUs each worker gets (CUDA_VISIBLE_DEVICES); ps stay on CPU (default 0)")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--sync", dest="mode", action="store_const", const="sync",
                      help="synchronous training (sets TENSORFLEET_MODE for the script's --sync/--async default)")
    mode.add_argument("--async", dest="mode", action="store_const", const="async", help="asynchronous training")
    run.add_argument("--dense", choices=("ps", "allreduce"), help="where the dense parameters live: on the ps, or "
                     "replicated on the workers and averaged by an all-reduce, tables on the ps (sets "
                     "TENSORFLEET_DENSE for the script's --dense default)")
    run.add_argument("--restart", choices=RESTART_MODES, help="restart a task that exits abnormally (default "
                     "on-failure), with exponential backoff")
    run.add_argument("--max-restarts", dest="max_restarts", type=non_negative_int, metavar="R",
                     help="give up on a task after R restarts (default 3)")
    run.add_argument("--restart-backoff", dest="restart_backoff", type=float, metavar="S",
                     help="seconds before a task's first restart, doubling with each one up to 30 (default 1)")
    run.add_argument("--logdir", metavar="DIR", help="per-task log files and events.jsonl (default: a new "
                     "temporary directory, printed at the end)")
    run.add_argument("--dashboard", type=port_number, nargs="?", const=0, metavar="PORT",
                     help="serve the live dashboard on 127.0.0.1:PORT (no PORT: a free port; PORT is taken only "
                     "when it is a number: '--dashboard train.py' runs train.py)")
    run.add_argument("--port", type=port_number, metavar="P", help="task ports P, P+1, ... (default: free ports)")
    run.add_argument("--name", help="the job's name in the views (default: the script's name)")
    run.add_argument("--progress-every", dest="progress_every", type=float,
                     default=float(os.environ.get("TENSORFLEET_PROGRESS_EVERY", 10.0)),
                     metavar="S", help="when the output is not a terminal, print the progress line every S "
                     "seconds (default 10; on a terminal it stays at the bottom)")
    run.add_argument("--backend", choices=BACKENDS,
                     help="the engine the tasks run on (default local): " + "; ".join(
                         f"{entry.name}: {entry.summary}" for entry in backends.ENGINES.values()))
    for engine, option in backends.options():  # each engine's own settings, as its registry line declares them
        run.add_argument(option.flag, dest=option.name, type=option.kind, metavar=option.metavar,
                         choices=option.choices or None, help=f"with --backend {engine.name}: {option.help}")
    run.add_argument("--coordinator", action="store_const", const=True, default=None,
                     help="in-graph replication: one more task, the chief, runs SCRIPT as the coordinator that "
                     "drives the workers (the script calls tfl.run_coordinated)")
    run.add_argument("--coordinator-outside", dest="coordinator", action="store_const", const="outside",
                     help="in-graph replication driven from a Python session of this machine (a notebook): the "
                     "ps and workers start, and the session joins as their coordinator with "
                     "tfl.join_fleet(LOGDIR)")
    run.add_argument("--dry-run", dest="dry_run", action="store_true",
                     help="print the tasks, ports and environment that would start, and start nothing")
    # Optional for argparse so that a missing one is our message (launch says what to give, with the usage line).
    run.add_argument("target", nargs="?", metavar="SCRIPT|JOBFILE",
                     help="the training script, or a .yaml/.toml job file")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="SCRIPT_ARGS",
                     help="arguments for SCRIPT, after '--'").required = False  # none is fine


def run_launch(args: argparse.Namespace, line: CommandLine) -> int:
    if args.target is None:
        line.parser.error(f"a SCRIPT or a job file (job.yaml / job.toml) is needed; usage: {line.parser.usage}")
    config = _job_config(args, line)
    # The tasks' gRPC errors are worth keeping: the launcher routes them to the task's log file.
    config.env.setdefault(GRPC_VERBOSITY, line.task_grpc_verbosity)
    from tensorfleet.backends import launcher  # the launcher loop and the engines load for this command only
    from tensorfleet.cluster import machine

    if backends.load(config.backend).runs_on_this_machine(config):
        _warn_if_oversubscribed(config.ps, config.workers, machine.usable_cores(), dry_run=args.dry_run)
    return launcher.launch(config, dry_run=args.dry_run, progress_every_s=args.progress_every)


def _job_config(args: argparse.Namespace, line: CommandLine) -> JobConfig:
    """The job of ``launch``'s (or ``slurm render``'s) flags, script or job file."""
    extra = line.script_args(args, args.target)
    names = ["ps", "workers", "gpus_per_worker", "mode", "dense", "restart", "max_restarts", "restart_backoff",
             "logdir", "dashboard", "port", "name", "backend", "coordinator",
             *(option.name for _, option in backends.options())]
    flags = {name: getattr(args, name) for name in names}
    if is_job_file(args.target):
        if extra:
            flags["args"] = extra
        return job_config(args.target, None, flags)
    return job_config(None, args.target, {**flags, "args": extra})


def _warn_if_oversubscribed(ps: int, workers: int, cores: int, *, dry_run: bool = False) -> None:
    """Say once that a fleet far larger than the machine will be slow; it runs anyway (a test fleet on a laptop
    is a fine thing to start). Workers compute all the time, a ps mostly waits: 1 ps + 2 workers on 2 cores is
    the quickstart's fleet and runs well, so only more workers than cores, or tasks past twice the cores, warn.
    A dry run starts nothing, so its warning says what a run would be, never that one starts."""
    tasks = ps + workers
    if workers > cores or tasks > 2 * cores:
        what = ("would share the cores and the job would be slow" if dry_run else
                "will share the cores and the job will be slow; starting it anyway")
        print(f"tensorfleet launch: warning: {tasks} tasks ({ps} ps + {workers} workers) on {cores} core(s): they "
              f"{what}", file=sys.stderr, flush=True)


# ----- dashboard


def _add_dashboard(commands: argparse._SubParsersAction) -> None:
    board = commands.add_parser(
        "dashboard", help="serve the live dashboard of a running fleet",
        description="Attach to a running fleet and serve its live dashboard and /metrics. The fleet is given "
                    "as --cluster (JSON or a JSON file), as --ps_hosts/--worker_hosts, or by TF_CONFIG.")
    board.add_argument("--cluster", help='the cluster, e.g. \'{"ps": ["host:2222"], "worker": ["host:2223"]}\', '
                       "or a file holding it")
    board.add_argument("--ps_hosts", help="comma-separated host:port list")
    board.add_argument("--worker_hosts", help="comma-separated host:port list")
    board.add_argument("--port", type=port_number, default=0, help="port to serve on (default: a free port)")
    board.add_argument("--host", default="127.0.0.1",
                       help="address to serve on (default 127.0.0.1; 0.0.0.0 exposes it to the network)")
    board.add_argument("--name", default="fleet", help="the job's name on the page")


def run_dashboard(args: argparse.Namespace, line: CommandLine) -> int:
    from tensorfleet.launch.attach import serve_dashboard
    return serve_dashboard(args)


# ----- ckpt and data


def _add_ckpt(commands: argparse._SubParsersAction) -> None:
    ckpt = commands.add_parser("ckpt", help="list or show checkpoints")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    ckpt_commands.add_parser("ls", help="list the checkpoints of a directory").add_argument("directory")
    ckpt_commands.add_parser("show", help="variables, shapes, step and optimizer of a checkpoint").add_argument(
        "path", help="a checkpoint directory (its latest checkpoint) or one checkpoint file")
    ckpt_commands.add_parser("compact", help="replace the latest chain of delta checkpoints with one full "
                             "checkpoint (run it where no job is saving)").add_argument("directory")


def run_ckpt(args: argparse.Namespace, line: CommandLine) -> int:
    from tensorfleet.launch import ckpt  # only this command needs safetensors loaded
    if args.ckpt_command == "compact":
        print(ckpt.compact(args.directory))
    else:
        print(ckpt.list_text(args.directory) if args.ckpt_command == "ls" else ckpt.show_text(args.path))
    return 0


def _add_data(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser("data", help="fetch the data sets that come from a package (MovieLens-100K)")
    data_commands = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    fetch = data_commands.add_parser("fetch", help="download a data set's package into the cache and verify it")
    fetch.add_argument("dataset", choices=["movielens"], help="movielens: MovieLens-100K, from the recbole wheel")
    fetch.add_argument("--cache", default=None, help="the cache folder (default: $TENSORFLEET_DATA, else "
                                                     "~/.cache/tensorfleet)")


def run_data(args: argparse.Namespace, line: CommandLine) -> int:
    from tensorfleet.data import movielens
    wheel = movielens.fetch(Path(args.cache) if args.cache else None)
    ratings = len(movielens.load(wheel.parent))
    print(f"MovieLens-100K: {ratings} ratings, verified, in {wheel}")
    return 0


# ----- serve-model and k8s render


def _add_serve_model(commands: argparse._SubParsersAction) -> None:
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
    serve.add_argument("--port", type=port_number, default=8500, help="port (default 8500; 0: a free one)")
    serve.add_argument("--poll-interval", dest="poll_interval", type=float, default=0.25, metavar="S",
                       help="how often to look for a new checkpoint, in seconds (default 0.25)")
    serve.add_argument("--no-reload", dest="follow", action="store_false",
                       help="serve the first checkpoint found and never apply a newer one")
    # The script's own flags (for serving_model) go after '--'; run_serve_model hands them over as args.script_args.


def run_serve_model(args: argparse.Namespace, line: CommandLine) -> int:
    from tensorfleet.serving.server import main as serve
    args.script_args = line.after_separator
    return serve(args)


def run_k8s(args: argparse.Namespace, line: CommandLine) -> int:
    args.script_args = line.script_args(args, args.script)
    return k8s.main(args)


def _add_slurm(commands: argparse._SubParsersAction) -> None:
    slurm = commands.add_parser("slurm", help="write the Slurm batch script of a job")
    actions = slurm.add_subparsers(dest="slurm_command", required=True, metavar="ACTION")
    render = actions.add_parser(
        "render", help="print the batch script of a job (sbatch it yourself, or use launch --backend slurm)",
        usage="tensorfleet slurm render [FLAGS] SCRIPT|JOBFILE [-- SCRIPT_ARGS ...] > job.sbatch",
        description="Print the Slurm batch script that runs the job: one task per ps and worker in one srun step, "
                    "roles by rank, the step run again from the last checkpoint when a rank dies (up to "
                    "--max-restarts). The flags are launch's; --backend is slurm.")
    _add_job_flags(render)


def run_slurm(args: argparse.Namespace, line: CommandLine) -> int:
    from tensorfleet.backends.slurm import check_slurm_config, rendered_script

    if args.target is None:
        line.parser.error(f"a SCRIPT or a job file (job.yaml / job.toml) is needed; usage: {line.parser.usage}")
    if args.backend not in (None, "slurm"):
        raise ConfigError(f"slurm render writes a Slurm job: --backend {args.backend} is not for it")
    args.backend = "slurm"
    config = _job_config(args, line)
    config.env.setdefault(GRPC_VERBOSITY, line.task_grpc_verbosity)
    check_slurm_config(config)
    print(rendered_script(config), end="")
    return 0


COMMANDS: dict[str, Command] = {
    "launch": Command(_add_launch, run_launch),
    "dashboard": Command(_add_dashboard, run_dashboard),
    "ckpt": Command(_add_ckpt, run_ckpt),
    "data": Command(_add_data, run_data),
    "serve-model": Command(_add_serve_model, run_serve_model),
    "k8s": Command(k8s.add_parser, run_k8s),
    "slurm": Command(_add_slurm, run_slurm),
}
