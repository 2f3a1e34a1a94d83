"""The entry point of one task of a training script, like ``tf.app.run`` for a cluster.

Every task runs the same script; this resolves which task this process is (flags
or TF_CONFIG), then either serves as a ps until the job is done or calls the
script's training function, answering the Status RPC on the task's own address
meanwhile (its step, loss and throughput, for the launcher and the dashboard).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch

from tensorfleet.cluster.environment import IN_GRAPH_ENV, env_switch, finished_linger_s
from tensorfleet.cluster.flags import cluster_from_flags, insecure_from_flags, memory_budget_from_flags
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, bind_address, is_loopback_host, parse_address
from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.wire import auth
from tensorfleet.worker.status import PROCESS_STATUS, serve_status, write_final_status

if TYPE_CHECKING:
    from tensorfleet.coordinator.coordinator import Coordinator
    from tensorfleet.train.session import TrainingSession
    from tensorfleet.worker.replica import Replica

TrainFn = Callable[[argparse.Namespace, ClusterSpec, TaskSpec], None]


def run_task(args: argparse.Namespace, train: TrainFn, *, intra_op_threads: int = 1) -> int:
    """Run this process's task: a ps serves until every worker is done; a worker calls ``train``.

    Args:
        args: parsed flags, including the cluster flags of ``add_cluster_flags``.
        train: ``train(args, cluster, task)``, called on chief and worker tasks.
        intra_op_threads: torch threads for this process (one per task suits a machine shared by tasks).
    Returns:
        the process exit code: 0, or 2 when the cluster flags or TF_CONFIG are wrong, when a ps on a
        non-loopback address has no job token (TENSORFLEET_TOKEN) and was not given ``--insecure``
        (or ``TENSORFLEET_INSECURE=1``), or when ``tensorfleet launch --coordinator`` started this script
        (between-graph: it would train on every worker by itself, with no coordinator driving them).

    Example:
        >>> sys.exit(run_task(parse_args(), train))   # doctest: +SKIP
    """
    try:
        if env_switch(IN_GRAPH_ENV, default=False, meaning="1 for a job of in-graph replication, else 0"):
            raise ConfigError(BETWEEN_GRAPH_IN_IN_GRAPH_JOB)
    except ConfigError as exc:
        return _config_error(exc)
    return _serve_or_train(args, train, intra_op_threads=intra_op_threads)


BETWEEN_GRAPH_IN_IN_GRAPH_JOB = (
    "this script is between-graph (it calls tfl.run_task: each worker trains by itself), but 'tensorfleet launch "
    "--coordinator' started it for in-graph replication, where a coordinator drives the workers: launch it "
    "without --coordinator, or write it with tfl.run_coordinated (as examples/mnist_coordinator.py)")


def _serve_or_train(args: argparse.Namespace, train: TrainFn, *, intra_op_threads: int) -> int:
    """``run_task`` once the job is known to be between-graph (and a ps of ``run_coordinated``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cluster, task = cluster_from_flags(args)
        _check_towers_are_used(args)
        insecure = insecure_from_flags(args)
        memory_budget = memory_budget_from_flags(args)
    except TensorfleetError as exc:
        return _config_error(exc)
    torch.set_num_threads(intra_op_threads)
    if task.job_name == "ps":
        from tensorfleet.ps.server import Server  # a worker never imports the ps (nor numba, for its tables)

        try:
            server = Server(cluster, job_name="ps", task_index=task.index, insecure=insecure,
                            memory_budget=memory_budget)
        except ConfigError as exc:  # no token on a non-loopback address, say: a restart would not fix it
            return _config_error(exc)
        server.join(linger_s=finished_linger_s())  # so that `tensorfleet dashboard` sees the job end
        write_final_status(task, server.status())
        return 0
    _warn_if_status_exposed(cluster, task)
    status_server = serve_status(cluster, task)  # what the launcher and the dashboard ask about
    try:
        train(args, cluster, task)
    finally:
        if status_server is not None:
            status_server.stop(0)
    write_final_status(task, PROCESS_STATUS.as_meta())
    return 0


SetupFn = Callable[[ClusterSpec, TaskSpec], "Replica"]
DriveFn = Callable[["Coordinator", "TrainingSession"], None]


def run_coordinated(args: argparse.Namespace, setup: SetupFn, drive: DriveFn, *, intra_op_threads: int = 1,
                    session_options: dict[str, Any] | None = None, max_pending: int | None = None) -> int:
    """Run this process's task of in-graph replication (``tensorfleet.coordinator``): a ps serves as in
    ``run_task``; a worker builds its replica (``setup(cluster, task)``) and runs the coordinator's closures until
    it says Done; the coordinator, the cluster's ``chief``, builds its replica the same way, initializes the ps in a
    ``TrainingSession`` (or restores the latest checkpoint; checkpoints and hooks from ``session_options``, which
    follow the closures' training) and calls ``drive(coordinator, session)``.

    Synchronous training aggregates the workers' gradients only: the coordinator pushes none, so by default a
    step waits for every worker (``replicas_to_aggregate`` = the workers; fewer makes backups), and each closure
    runs on every worker. ``max_pending`` bounds the closures scheduled ahead (default: two per worker).

    Example:
        >>> sys.exit(run_coordinated(parse_args(), setup, drive))   # doctest: +SKIP
    """
    from tensorfleet.coordinator.coordinator import Coordinator
    from tensorfleet.coordinator.remote import WorkerContext
    from tensorfleet.coordinator.worker import ClosureServer
    from tensorfleet.train.session import TrainingSession

    try:
        cluster, task = cluster_from_flags(args)
        if task.job_name == "worker" and not cluster.num_tasks("chief"):
            raise ConfigError("in-graph replication needs a coordinator: a 'chief' job in the cluster (TF_CONFIG), "
                              "as 'tensorfleet launch --coordinator' starts it")
    except TensorfleetError as exc:
        return _config_error(exc)
    if task.job_name == "ps":
        return _serve_or_train(args, lambda *unused: None, intra_op_threads=intra_op_threads)
    torch.set_num_threads(intra_op_threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    replica, workers = setup(cluster, task), cluster.num_tasks("worker")
    try:
        _aggregate_workers_only(replica, workers)
    except TensorfleetError as exc:
        return _config_error(exc)
    if task.job_name == "worker":
        with TrainingSession(replica, log_step_count_steps=None) as session:  # waits for the coordinator's Init
            ClosureServer(cluster, task, WorkerContext(session=session)).serve()
        write_final_status(task, PROCESS_STATUS.as_meta())
        return 0
    status_server = serve_status(cluster, task)  # the launcher and the dashboard follow the job through it
    try:
        with TrainingSession(replica, **(session_options or {})) as session:
            with Coordinator(cluster, session=session, max_pending=max_pending or 2 * workers) as coordinator:
                drive(coordinator, session)  # a driver that raised shuts the coordinator down at once
    finally:
        if status_server is not None:
            status_server.stop(0)
    write_final_status(task, PROCESS_STATUS.as_meta())
    return 0


def _aggregate_workers_only(replica: "Replica", workers: int) -> None:
    """In synchronous training the coordinator is a replica that never pushes: a step aggregates the workers'
    gradients only (all of them unless the script asked for fewer, the others then backups).

    Raises:
        ConfigError: the script asked to aggregate more gradients than there are workers.
    """
    if replica.sync is None:
        return
    options = getattr(replica, "options", None)
    asked = options.sync.replicas_to_aggregate if options is not None and options.sync is not None else None
    if asked is not None and asked > workers:
        raise ConfigError(f"replicas_to_aggregate={asked} but the job has {workers} worker(s), and the coordinator "
                          "pushes no gradient: aggregate at most the workers")
    replica.sync = dataclasses.replace(replica.sync, replicas_to_aggregate=asked or workers)


def _config_error(exc: TensorfleetError) -> int:
    print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr)
    return 2


def _warn_if_status_exposed(cluster: ClusterSpec, task: TaskSpec) -> None:
    """A worker without a token still starts on a non-loopback address (its Status only informs), but says so."""
    try:
        token = auth.job_token()
    except ConfigError:
        return  # an unreadable token file: the worker's first call to the ps says so, with its name
    address = cluster.task_address(task.job_name, task.index)
    if token is None and not is_loopback_host(parse_address(bind_address(address))[0]):
        logging.getLogger(__name__).warning(
            "%s: no job token (TENSORFLEET_TOKEN): its Status on %s answers anyone who can reach it, and a ps "
            "on a non-loopback address serves it only with --insecure; set TENSORFLEET_TOKEN (or "
            "TENSORFLEET_TOKEN_FILE) to the same secret on every task", task.name, address)


def _check_towers_are_used(args: argparse.Namespace) -> None:
    """TENSORFLEET_TOWERS=K reaches scripts through ``--towers``; one without that flag would ignore it."""
    wanted = os.environ.get("TENSORFLEET_TOWERS", "1").strip()
    if not hasattr(args, "towers") and wanted not in ("", "1"):
        raise ConfigError(f"TENSORFLEET_TOWERS={wanted} is set but this script does not train with towers "
                          "(it has no --towers flag: see add_training_flags(parser, towers=True) and run_towers); "
                          "unset it")
