"""ClusterSpec and TaskSpec: who is in the job and which task this process is.

A cluster comes from one of three places, all with the classic semantics:

* a dict ``{"ps": ["host:port", ...], "worker": [...]}`` (optionally ``"chief": [...]``);
* the ``TF_CONFIG`` environment variable, as Kubernetes operators set it:
  ``{"cluster": {...}, "task": {"type": "worker", "index": 0}}``;
* the four flags of the classic examples: ``--ps_hosts --worker_hosts --job_name --task_index``
  (``cluster/flags.py``, which also reads Slurm's environment in a job step).

The chief is ``chief:0`` when the cluster has a ``chief`` job (TF_CONFIG from an
operator), otherwise ``worker:0``, as in the classic examples.  Replicas (the
tasks that compute gradients) are the chief job first, then the workers.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from tensorfleet.cluster.environment import env_switch
from tensorfleet.errors import ClusterSpecError

KNOWN_JOBS = ("chief", "worker", "ps", "evaluator")
TRAINING_JOBS = ("chief", "worker")


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6]:port``) and check the port; raise ClusterSpecError if malformed."""
    if not isinstance(address, str) or ":" not in address:
        raise ClusterSpecError(f"malformed address {address!r}: expected 'host:port', e.g. '127.0.0.1:2222'")
    host, _, port_text = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or any(c.isspace() for c in host):
        raise ClusterSpecError(f"malformed address {address!r}: the host is empty or has spaces")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ClusterSpecError(f"malformed address {address!r}: the port must be an integer in 1..65535")
    return host, int(port_text)


LOOPBACK_HOSTS = ("localhost", "::1")
# 1: a ps with no job token may serve on a non-loopback address (see ``insecure_from_env``).
INSECURE_ENV = "TENSORFLEET_INSECURE"
MEMORY_BUDGET_ENV = "TENSORFLEET_PS_MEMORY_BUDGET"


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and a loopback IP (127.0.0.0/8, ``::1``); False for anything else.

    ``0.0.0.0``/``::`` (every interface), a real interface's address and any other name are not
    loopback: what listens there can be reached from other machines.
    """
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a DNS name: it may resolve to anything
        return False


def bind_address(address: str) -> str:
    """Where a task listens for its cluster ``address``: loopback stays loopback, any other host binds all.

    A task named by a DNS name (a Kubernetes Service) or an IP address listens on every
    interface, as classic TensorFlow servers do; it cannot bind a name that only resolves
    once its pod is ready.  A cluster on 127.0.0.1 is never exposed beyond this machine.
    """
    host, port = parse_address(address)
    if host in LOOPBACK_HOSTS or host.startswith("127."):
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"0.0.0.0:{port}"


@dataclass(frozen=True)
class TaskSpec:
    """One task of the cluster: ``/job:<job_name>/task:<index>``."""

    job_name: str
    index: int

    def __post_init__(self) -> None:
        if not isinstance(self.index, int) or self.index < 0:
            raise ClusterSpecError(f"task index {self.index!r} must be a non-negative integer")

    @property
    def name(self) -> str:
        return f"/job:{self.job_name}/task:{self.index}"

    @property
    def short(self) -> str:
        """``worker:1``: the prefix of this task's log lines."""
        return f"{self.job_name}:{self.index}"


@dataclass(frozen=True)
class ClusterSpec:
    """The jobs of a cluster and the address of every task, validated on construction.

    Example:
        >>> spec = ClusterSpec.from_dict({"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]})
        >>> spec.task_address("worker", 0)
        '127.0.0.1:2223'
    """

    jobs: Mapping[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        if not isinstance(self.jobs, Mapping) or not self.jobs:
            raise ClusterSpecError("a cluster needs at least one job, e.g. {'ps': [...], 'worker': [...]}")
        seen: dict[str, str] = {}
        for job, addresses in self.jobs.items():
            if job not in KNOWN_JOBS:
                raise ClusterSpecError(f"unknown job {job!r}: valid jobs are {', '.join(KNOWN_JOBS)}")
            if job == "chief" and len(addresses) != 1:
                raise ClusterSpecError(f"the chief job must have exactly one task, got {len(addresses)}")
            for index, address in enumerate(addresses):
                parse_address(address)
                where = f"/job:{job}/task:{index}"
                if address in seen:
                    raise ClusterSpecError(f"duplicate address {address}: used by {seen[address]} and {where}")
                seen[address] = where
        if not any(self.jobs.get(job) for job in TRAINING_JOBS):
            raise ClusterSpecError("the cluster has no worker: add a 'worker' (or 'chief') job")

    @classmethod
    def from_dict(cls, jobs: Mapping[str, Sequence[str]]) -> "ClusterSpec":
        """Build from ``{"ps": [...], "worker": [...]}``; a job value must be a list of 'host:port'."""
        if not isinstance(jobs, Mapping):
            raise ClusterSpecError(f"a cluster must be a dict of job -> list of 'host:port', got {type(jobs).__name__}")
        clean: dict[str, tuple[str, ...]] = {}
        for job, addresses in jobs.items():
            if isinstance(addresses, str) or not isinstance(addresses, Sequence):
                raise ClusterSpecError(f"job {job!r} must be a list of 'host:port' strings, got {addresses!r}")
            if addresses:
                clean[str(job)] = tuple(addresses)
        return cls(clean)

    def as_dict(self) -> dict[str, list[str]]:
        return {job: list(addresses) for job, addresses in self.jobs.items()}

    def num_tasks(self, job_name: str) -> int:
        return len(self.jobs.get(job_name, ()))

    def task_address(self, job_name: str, index: int) -> str:
        self.check_task(TaskSpec(job_name, index))
        return self.jobs[job_name][index]

    def check_task(self, task: TaskSpec) -> None:
        """Raise ClusterSpecError unless ``task`` is in this cluster."""
        if task.job_name not in self.jobs:
            raise ClusterSpecError(
                f"job_name {task.job_name!r} is not in the cluster: it has {', '.join(sorted(self.jobs))}")
        count = len(self.jobs[task.job_name])
        if task.index >= count:
            raise ClusterSpecError(
                f"task_index {task.index} is out of range for job {task.job_name!r}, "
                f"which has {count} task(s): valid indices are 0..{count - 1}")

    @property
    def ps_addresses(self) -> tuple[str, ...]:
        return tuple(self.jobs.get("ps", ()))

    @property
    def replicas(self) -> tuple[TaskSpec, ...]:
        """The tasks that train, chief first: replica id = position in this tuple."""
        return tuple(TaskSpec(job, i) for job in TRAINING_JOBS for i in range(self.num_tasks(job)))

    @property
    def chief(self) -> TaskSpec:
        return self.replicas[0]

    def is_chief(self, task: TaskSpec) -> bool:
        return task == self.chief

    def replica_id(self, task: TaskSpec) -> int:
        """Position of a training task among the replicas (chief 0); used to seed its data order."""
        self.check_task(task)
        if task.job_name not in TRAINING_JOBS:
            raise ClusterSpecError(f"{task.name} is not a training task (only chief and worker tasks are)")
        return self.replicas.index(task)

    def to_tf_config(self, task: TaskSpec) -> str:
        """The TF_CONFIG JSON that tells ``task`` who it is in this cluster."""
        self.check_task(task)
        return json.dumps({"cluster": self.as_dict(), "task": {"type": task.job_name, "index": task.index}})


TASK_TYPE_ENV = "TENSORFLEET_TASK_TYPE"
TASK_INDEX_ENV = "TENSORFLEET_TASK_INDEX"


def from_tf_config(text: str, environ: Mapping[str, str] | None = None) -> tuple[ClusterSpec, TaskSpec]:
    """Parse a TF_CONFIG JSON string into the cluster and this process's task.

    A TF_CONFIG without ``"task"`` takes it from ``TENSORFLEET_TASK_TYPE`` and ``TENSORFLEET_TASK_INDEX``: a
    JobSet's pods share one template per replicated job, and learn their index from the downward API.
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterSpecError(f"TF_CONFIG is not valid JSON ({exc.msg} at char {exc.pos})") from None
    environ = os.environ if environ is None else environ
    if isinstance(config, dict) and "task" not in config and environ.get(TASK_TYPE_ENV):
        index = environ.get(TASK_INDEX_ENV, "")
        if not index.isdigit():
            raise ClusterSpecError(f"{TASK_INDEX_ENV}={index!r} must be a task index (0, 1, ...), with "
                                   f"{TASK_TYPE_ENV}={environ[TASK_TYPE_ENV]!r} and a TF_CONFIG without \"task\"")
        config["task"] = {"type": environ[TASK_TYPE_ENV], "index": int(index)}
    if not isinstance(config, dict) or "cluster" not in config or "task" not in config:
        raise ClusterSpecError('TF_CONFIG must look like {"cluster": {...}, "task": {"type": "worker", "index": 0}}')
    cluster = ClusterSpec.from_dict(config["cluster"])
    task_config = config["task"]
    if not isinstance(task_config, dict) or "type" not in task_config or "index" not in task_config:
        raise ClusterSpecError('TF_CONFIG "task" needs "type" and "index", e.g. {"type": "worker", "index": 0}')
    index = task_config["index"]
    if isinstance(index, bool) or not isinstance(index, int):
        raise ClusterSpecError(f'TF_CONFIG task "index" must be an integer, got {index!r}')
    task = TaskSpec(str(task_config["type"]), index)
    cluster.check_task(task)
    return cluster, task


def insecure_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``TENSORFLEET_INSECURE``: 1 lets a ps without a token serve on a non-loopback address (off by default)."""
    return env_switch(INSECURE_ENV, default=False, environ=environ,
                      meaning="1 (a ps without a token may serve on a non-loopback address, accepting "
                              "unauthenticated calls) or 0 (the default: it refuses to start)")
