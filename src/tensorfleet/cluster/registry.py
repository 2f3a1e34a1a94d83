"""Where a task finds its peers' current addresses, on a backend that may move a task to a new one.

``TF_CONFIG`` is the cluster as it was when a task started. On Ray, a task whose node died is started again on
another node, at a new address (issue 31): the launcher raises the cluster's *version* and sends the new cluster
to every task's actor, which writes it to a file on the task's node; the task knows the file by
``CLUSTER_FILE_ENV``. A task whose connection to a peer fails reads the file (``current_address``) and dials the
address it names. On a backend whose tasks keep their addresses (local, Kubernetes' stable names) there is no
file, and ``TF_CONFIG`` stays the truth.

The file is written whole and renamed into place, so a reader sees one version or the next, never half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.errors import ClusterSpecError

CLUSTER_FILE_ENV = "TENSORFLEET_CLUSTER_FILE"


def write_cluster(path: Path, cluster: Mapping[str, list[str]], version: int) -> None:
    """Write ``cluster`` (job -> addresses) as ``version`` to ``path``, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps({"version": version, "cluster": dict(cluster)}))
    os.replace(partial, path)


def read_cluster(path: Path) -> tuple[int, ClusterSpec]:
    """The version and the cluster written to ``path``.

    Raises:
        ClusterSpecError: the file is missing or is not a cluster written by ``write_cluster``.
    """
    try:
        written = json.loads(path.read_text())
        return int(written["version"]), ClusterSpec.from_dict(written["cluster"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ClusterSpecError(f"cannot read the job's current cluster from {path} ({exc}); it is written by "
                               "the launcher's task actor on this node: is the task running under "
                               "'tensorfleet launch --backend ray'?") from None


def current_address(job_name: str, index: int, environ: Mapping[str, str] | None = None) -> str | None:
    """The current address of task ``job_name:index``, from the cluster file named in the environment; None where
    there is no file (the backend never moves a task) or it does not name the task (then the caller keeps the
    address it has)."""
    name = (os.environ if environ is None else environ).get(CLUSTER_FILE_ENV)
    if not name:
        return None
    _, cluster = read_cluster(Path(name))
    if index >= cluster.num_tasks(job_name):
        return None
    return cluster.task_address(job_name, index)
