"""The command line of a task: the classic cluster flags, and where the cluster comes from when none is given.

``add_cluster_flags`` adds ``--ps_hosts --worker_hosts --job_name --task_index`` (and ``--insecure``,
``--ps_memory_budget``); ``cluster_from_flags`` resolves them, else ``TF_CONFIG``, else Slurm's environment in a
job step (``cluster/slurm.py``). It sits above ``spec.py`` and ``slurm.py``, which both build on ``spec.py``.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Mapping

from tensorfleet.cluster import slurm
from tensorfleet.cluster.spec import (INSECURE_ENV, MEMORY_BUDGET_ENV, ClusterSpec, TaskSpec, from_tf_config,
                                      insecure_from_env)
from tensorfleet.errors import ClusterSpecError


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """Add the classic ``--ps_hosts --worker_hosts --job_name --task_index`` flags to a parser, and ``--insecure``.

    ``--insecure`` lets a ps with no job token start on a non-loopback address (see ``insecure_from_flags``).
    It also turns off the parser's abbreviations: ``--ps 1`` must be an error, not ``--ps_hosts=1``.
    """
    parser.allow_abbrev = False
    group = parser.add_argument_group("cluster (or set TF_CONFIG instead)")
    group.add_argument("--ps_hosts", default=None, help="comma-separated host:port of the ps tasks")
    group.add_argument("--worker_hosts", default=None, help="comma-separated host:port of the worker tasks")
    group.add_argument("--job_name", default=None, help="'ps' or 'worker'")
    group.add_argument("--task_index", type=int, default=None, help="index of this task within its job")
    group.add_argument("--slurm_ps", "--slurm-ps", dest="slurm_ps", default=None, metavar="N|per-node",
                       help="in a Slurm step (srun) without the flags above or TF_CONFIG: the first N ranks are "
                            "the ps, or 'per-node': the first rank of each node (also: TENSORFLEET_SLURM_PS; "
                            "default 1)")
    parser.add_argument("--insecure", action="store_true", default=False,
                        help="on a non-loopback address with no job token (TENSORFLEET_TOKEN), let a ps start "
                             "anyway and accept unauthenticated calls: only on a trusted network "
                             f"(also: {INSECURE_ENV}=1)")
    parser.add_argument("--ps_memory_budget", default=None, metavar="SIZE",
                        help="what a ps's embedding tables may hold (e.g. 8GiB, 500MB): beyond it the least "
                             f"recently updated rows are evicted (also: {MEMORY_BUDGET_ENV}; default: no bound)")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_size(text: str, *, what: str) -> int:
    """Bytes from ``8GiB``, ``500MB``, ``1.5GiB`` or a plain number of bytes; ClusterSpecError naming ``what``."""
    match = _SIZE.match(str(text))
    if match is None or float(match.group(1)) <= 0:
        raise ClusterSpecError(f"{what}={text!r} is not a size: write e.g. 8GiB, 500MB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])


def memory_budget_from_flags(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int | None:
    """``--ps_memory_budget`` (from ``add_cluster_flags``), else ``TENSORFLEET_PS_MEMORY_BUDGET``, in bytes."""
    environ = os.environ if environ is None else environ
    text = getattr(args, "ps_memory_budget", None)
    if text is not None:
        return parse_size(text, what="--ps_memory_budget")
    text = environ.get(MEMORY_BUDGET_ENV)
    return parse_size(text, what=MEMORY_BUDGET_ENV) if text else None


def insecure_from_flags(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> bool:
    """``--insecure`` (from ``add_cluster_flags``), or ``TENSORFLEET_INSECURE`` when the flag is not given."""
    return bool(getattr(args, "insecure", False)) or insecure_from_env(environ)


def cluster_from_flags(args: argparse.Namespace,
                       environ: Mapping[str, str] | None = None) -> tuple[ClusterSpec, TaskSpec]:
    """Resolve the cluster from the classic flags, or from TF_CONFIG when no flag is given, or else from Slurm's
    environment in a job step (``cluster/slurm.py``).

    Raises:
        ClusterSpecError: a flag is missing or wrong, or no cluster is given at all.
    """
    environ = os.environ if environ is None else environ
    names = ("ps_hosts", "worker_hosts", "job_name", "task_index")
    given = {name: getattr(args, name, None) for name in names}
    if all(value is None for value in given.values()):
        if environ.get("TF_CONFIG"):
            return from_tf_config(environ["TF_CONFIG"], environ)
        if slurm.in_step(environ):
            return slurm.slurm_cluster(environ, getattr(args, "slurm_ps", None))
        raise ClusterSpecError("no cluster given: pass --ps_hosts, --worker_hosts, --job_name and --task_index, "
                               "or set TF_CONFIG, or run the ranks with srun in a Slurm allocation, or start the "
                               "job with 'tensorfleet launch'")
    missing = [f"--{name}" for name in ("worker_hosts", "job_name", "task_index") if given[name] is None]
    if missing:
        raise ClusterSpecError(f"missing flag(s) {', '.join(missing)}: all of --ps_hosts --worker_hosts "
                               "--job_name --task_index are needed (or none, with TF_CONFIG set)")
    jobs = {"worker": split_hosts(given["worker_hosts"]), "ps": split_hosts(given["ps_hosts"] or "")}
    cluster = ClusterSpec.from_dict(jobs)
    task = TaskSpec(given["job_name"], given["task_index"])
    cluster.check_task(task)
    return cluster, task


def split_hosts(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]
