"""Render a training fleet as Kubernetes manifests: ``tensorfleet k8s render``.

Kubernetes is the engine for fleets that outgrow one machine; this module only
writes YAML (no cluster access), so what it renders can be reviewed, diffed and
applied with ``kubectl``.  Four formats:

* ``manifests`` (plain Kubernetes, no operator needed).  Every task
  (``ps:0..N-1``, ``worker:0..M-1``) gets a headless Service and a ``batch/v1``
  Job of one pod.  The Service gives the task a stable DNS name,
  ``NAME-ps-0.NAMESPACE.svc``, that resolves straight to the pod's IP: headless
  means no proxy in between, so the ps data port (whatever the OS gave, announced
  by Status) is reachable as well as the gRPC port.  ``publishNotReadyAddresses``
  publishes the name as soon as the pod has an IP, because tasks dial each other
  while starting.  Each pod gets ``TF_CONFIG`` built from those names by
  ``ClusterSpec.to_tf_config``, the same format ``from_tf_config`` reads.
  The fleet ends when the workers finish: each ps exits 0 once every worker has
  said Done, so every Job completes.  A worker that fails says nothing (its
  restart takes its place); one whose Job gives up (``never``, or ``backoffLimit``
  spent) leaves the ps Jobs running: delete the job's objects (``kubectl delete
  -f``) to end them.
* ``jobset``: one ``JobSet`` (``jobset.x-k8s.io/v1alpha2``, the base of Kubeflow
  Trainer v2) with two replicated jobs, ``ps`` and ``worker``, a one-pod Job per
  task. JobSet makes the headless Service and the pods' stable names
  (``NAME-ps-0-0.NAME``); the pods of a replicated job share one template, so
  TF_CONFIG holds the cluster and each pod learns its index from JobSet's
  ``job-index`` annotation (downward API, ``TENSORFLEET_TASK_INDEX``).
* ``trainjob``: a Kubeflow Trainer v2 ``TrainJob`` and the ``TrainingRuntime`` it
  names, whose template is that JobSet with the workers as Trainer's ``node``: one
  Job (``replicas: 1``) of M indexed pods, each learning its index from the Job's
  completion index; the ps stay a replicated job of their own.
* ``tfjob``: one Kubeflow ``TFJob``; the training operator creates the pods and
  Services and injects ``TF_CONFIG`` itself (its names follow the same
  ``NAME-ps-0`` pattern). Kubeflow's v1 training operator is deprecated: use
  ``jobset`` or ``trainjob``.

Restart policy mirrors the local supervisor: ``on-failure`` restarts a failed
task up to ``max_restarts`` times (pod ``OnFailure`` and Job ``backoffLimit`` for
a one-pod Job; ``backoffLimitPerIndex`` for Trainer's node Job); ``never`` lets the
first failure end that task's Job. A TFJob's ``runPolicy.backoffLimit`` is the one
exception: it counts the restarts of all its tasks together.

Every name derived from the job's name must be a DNS label (at most 63
characters): a task's Service and Job (``NAME-worker-3``), and where JobSet makes
the pods, the longest pod name with the Job controller's random end
(``NAME-worker-3-0-x7k2q``), which JobSet's webhook checks. ``max_name_length``
says how long the name may be for a format and a fleet's shape.

Example:
    >>> job = K8sJob(name="mnist", num_ps=1, num_workers=2, image="repo/tf:1", script="train.py")
    >>> [d["kind"] for d in render_manifests(job)].count("Service")
    3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from tensorfleet.cluster.spec import TASK_INDEX_ENV, TASK_TYPE_ENV, ClusterSpec, TaskSpec
from tensorfleet.errors import ConfigError
from tensorfleet.launch.config import DENSE_ENV, DENSE_HOMES
from tensorfleet.wire.auth import TOKEN_ENV, new_token

RESTART_POLICIES = {"on-failure": "OnFailure", "never": "Never"}
FORMATS = ("manifests", "tfjob", "jobset", "trainjob")
GPU_RESOURCE = "nvidia.com/gpu"
PORT_NAME = "grpc"
CONTAINER_NAME = "tensorfleet"
TFJOB_CONTAINER_NAME = "tensorflow"  # the training operator finds the task's container by this name
TFJOB_PORT_NAME = "tfjob-port"  # ... and its port by this one
MAX_NAME_LENGTH = 63  # Service names and label values are DNS labels

_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# A Kubernetes quantity without a sign: 500m, 1.5, 2Gi, 1e3.
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([numkMGTPE]|[KMGTPE]i|[eE][+-]?\d+)?")


@dataclass(frozen=True)
class K8sJob:
    """One training fleet on Kubernetes, validated on construction.

    Resource requests (``cpu``, ``memory``) apply to every task; GPUs only to
    workers, since a ps applies updates on CPU.

    Raises:
        ConfigError: a value is invalid; the message quotes it and says what is valid.
    """

    name: str
    num_ps: int
    num_workers: int
    image: str
    script: str
    script_args: tuple[str, ...] = ()
    gpus_per_worker: int = 0
    namespace: str = "default"
    restart: str = "on-failure"
    max_restarts: int = 3
    port: int = 2222
    cpu: str = "1"
    memory: str = "2Gi"
    token: str = field(default_factory=new_token, repr=False)  # the job's secret, rendered as a Secret
    token_secret: str | None = field(default=None, repr=False)  # an existing Secret (key "token") instead
    dense: str | None = None  # where dense parameters live (TENSORFLEET_DENSE in every pod); None: the script's

    def __post_init__(self) -> None:
        if not isinstance(self.token, str) or len(self.token) < 16 or any(c.isspace() for c in self.token):
            raise ConfigError("token must be a string of at least 16 characters without spaces (an empty one "
                              "would turn authentication off); leave it out to get a new random one")
        if self.token_secret is not None and (not isinstance(self.token_secret, str)
                                              or not _DNS_1123.fullmatch(self.token_secret)):
            raise ConfigError(f"token secret {self.token_secret!r} is not a Secret name (a DNS-1123 label)")
        object.__setattr__(self, "script_args", tuple(self.script_args))
        for name, low in (("num_ps", 1), ("num_workers", 1), ("gpus_per_worker", 0), ("max_restarts", 0)):
            _check_int(name, getattr(self, name), low)
        _check_int("port", self.port, 1, 65535)
        self._check_names()
        if self.dense is not None and self.dense not in DENSE_HOMES:
            raise ConfigError(f"dense {self.dense!r} is not valid: use one of {', '.join(DENSE_HOMES)}")
        if self.restart not in RESTART_POLICIES:
            raise ConfigError(f"restart {self.restart!r} is not valid: use one of {', '.join(RESTART_POLICIES)}")
        for name in ("image", "script"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or any(c.isspace() for c in value):
                raise ConfigError(f"{name} {value!r} must be a non-empty string without spaces")
        for name in ("cpu", "memory"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _QUANTITY.fullmatch(value):
                raise ConfigError(f"{name} {value!r} is not a Kubernetes quantity: use e.g. '500m', '2', "
                                       "'512Mi' or '4Gi'")

    def _check_names(self) -> None:
        if not isinstance(self.name, str) or not _DNS_1035.fullmatch(self.name):
            raise ConfigError(f"name {self.name!r} is not a DNS-1035 label: use lowercase letters, digits "
                                   "and '-', starting with a letter and ending with a letter or digit")
        # manifests' (and tfjob's) names; the longer ones of jobset and trainjob are checked as they render
        check_name_length(self.name, "manifests", self.num_ps, self.num_workers)
        if (not isinstance(self.namespace, str) or len(self.namespace) > MAX_NAME_LENGTH
                or not _DNS_1123.fullmatch(self.namespace)):
            raise ConfigError(f"namespace {self.namespace!r} is not a DNS-1123 label: lowercase letters, "
                                   f"digits and '-', at most {MAX_NAME_LENGTH} characters")

    @property
    def tasks(self) -> tuple[TaskSpec, ...]:
        """Every task, ps first: the order the objects are rendered in."""
        return (tuple(TaskSpec("ps", i) for i in range(self.num_ps))
                + tuple(TaskSpec("worker", i) for i in range(self.num_workers)))

    def task_name(self, task: TaskSpec) -> str:
        """``NAME-worker-1``: the task's Service and Job name (the TFJob operator uses the same)."""
        return f"{self.name}-{task.job_name}-{task.index}"

    def cluster_spec(self) -> ClusterSpec:
        """The cluster as every pod sees it: the tasks' Service DNS names and the common port."""
        hosts = {job: [f"{self.task_name(TaskSpec(job, i))}.{self.namespace}.svc:{self.port}" for i in range(count)]
                 for job, count in (("ps", self.num_ps), ("worker", self.num_workers))}
        return ClusterSpec.from_dict(hosts)


RANDOM_END = "-xxxxx"  # the 5 random characters the Job controller ends a pod's name with; JobSet's webhook counts them


def derived_names(fmt: str, name: str, num_ps: int, num_workers: int) -> tuple[str, str]:
    """The longest names format ``fmt`` derives from ``name`` for the last ps and the last worker, each of which
    must be a DNS label: Services and Jobs (``manifests``) or the operator's pods and Services (``tfjob``),
    ``NAME-worker-3``; the pods JobSet makes (``jobset``, ``trainjob``), with the random end JobSet's webhook
    counts in (its pods are ``NAME-RJOB-JOBINDEX-PODINDEX-xxxxx``)."""
    ps, worker = f"{name}-ps-{num_ps - 1}", f"{name}-worker-{num_workers - 1}"
    if fmt == "jobset":
        return f"{ps}-0{RANDOM_END}", f"{worker}-0{RANDOM_END}"
    if fmt == "trainjob":  # the workers are the pods of Trainer's one node Job
        return f"{ps}-0{RANDOM_END}", f"{name}-{TRAINER_NODE}-0-{num_workers - 1}{RANDOM_END}"
    return ps, worker


def max_name_length(fmt: str, num_ps: int, num_workers: int) -> int:
    """How long a job's name may be in format ``fmt`` with this many tasks: every derived name within 63."""
    return MAX_NAME_LENGTH - max(len(n) for n in derived_names(fmt, "", num_ps, num_workers))


def check_name_length(name: str, fmt: str, num_ps: int, num_workers: int) -> None:
    """Refuse a name whose derived names would not be DNS labels, saying how long it may be for this shape.

    Raises:
        ConfigError: ``name`` is too long for ``fmt`` with ``num_ps`` ps and ``num_workers`` workers.
    """
    room = max_name_length(fmt, num_ps, num_workers)
    if len(name) > room:
        longest = max(derived_names(fmt, name, num_ps, num_workers), key=len)
        raise ConfigError(f"name {name!r} is too long for --format {fmt} with {num_ps} ps and {num_workers} "
                          f"workers: use at most {room} characters ({longest!r} would have {len(longest)}, "
                          f"over Kubernetes' {MAX_NAME_LENGTH})")


def _check_int(field: str, value: Any, low: int, high: int | None = None) -> None:
    valid = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ConfigError(f"{field} {value!r} is not valid: it must be {valid}")


def labels(job: K8sJob, task: TaskSpec | None = None) -> dict[str, str]:
    """The labels of every object; with ``task``, the ones that select exactly that task's pod."""
    result = {"app.kubernetes.io/name": "tensorfleet", "app.kubernetes.io/instance": job.name}
    if task is not None:
        result.update({"tensorfleet.io/replica-type": task.job_name, "tensorfleet.io/replica-index": str(task.index)})
    return result


def _resources(job: K8sJob, job_name: str) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": job.cpu, "memory": job.memory}
    if job_name != "worker" or job.gpus_per_worker == 0:
        return {"requests": requests}
    # Extended resources cannot be overcommitted: Kubernetes wants requests == limits.
    return {"requests": {**requests, GPU_RESOURCE: job.gpus_per_worker},
            "limits": {GPU_RESOURCE: job.gpus_per_worker}}


def _container(job: K8sJob, job_name: str, *, name: str, port_name: str,
               tf_config: str | None) -> dict[str, Any]:
    env = [{"name": "TF_CONFIG", "value": tf_config}] if tf_config is not None else []
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})  # log lines reach `kubectl logs` as they happen
    # Every task requires the job's token of every caller; it comes from the Secret, not the pod spec.
    env.append({"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name(job), "key": "token"}}})
    if job.dense is not None:  # hybrid: the workers' collective meets through ps 0, nothing else to render
        env.append({"name": DENSE_ENV, "value": job.dense})
    return {"name": name, "image": job.image, "command": ["python", job.script, *job.script_args],
            "env": env, "ports": [{"name": port_name, "containerPort": job.port, "protocol": "TCP"}],
            "resources": _resources(job, job_name)}


def _metadata(job: K8sJob, name: str, task: TaskSpec | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": job.namespace, "labels": labels(job, task)}


def secret_name(job: K8sJob) -> str:
    return job.token_secret or f"{job.name}-token"


def render_secret(job: K8sJob) -> dict[str, Any]:
    """The job's shared token (a new random one per render), which every task requires of every caller."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _metadata(job, secret_name(job)), "type": "Opaque",
            "stringData": {"token": job.token}}


def render_service(job: K8sJob, task: TaskSpec) -> dict[str, Any]:
    """The headless Service that gives ``task`` its DNS name, published before the pod is ready."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(job, job.task_name(task), task),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels(job, task),
                     "ports": [{"name": PORT_NAME, "port": job.port, "targetPort": PORT_NAME, "protocol": "TCP"}]}}


def render_job(job: K8sJob, task: TaskSpec) -> dict[str, Any]:
    """The Job running ``task``'s single pod with its TF_CONFIG; restarts per ``job.restart``."""
    container = _container(job, task.job_name, name=CONTAINER_NAME, port_name=PORT_NAME,
                           tf_config=job.cluster_spec().to_tf_config(task))
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(job, job.task_name(task), task),
            "spec": {"completions": 1, "parallelism": 1, "backoffLimit": _backoff_limit(job),
                     "template": {"metadata": {"labels": labels(job, task)},
                                  "spec": {"restartPolicy": RESTART_POLICIES[job.restart],
                                           "containers": [container]}}}}


def _backoff_limit(job: K8sJob) -> int:
    return job.max_restarts if job.restart == "on-failure" else 0


def render_manifests(job: K8sJob) -> list[dict[str, Any]]:
    """The token's Secret, every Service, then every Job: names resolve by the time the pods dial them."""
    return _secrets(job) + [render_service(job, t) for t in job.tasks] + [render_job(job, t) for t in job.tasks]


def _secrets(job: K8sJob) -> list[dict[str, Any]]:
    """The token's Secret, unless the user names an existing one (then nothing secret is rendered)."""
    return [] if job.token_secret else [render_secret(job)]


def render_tfjob(job: K8sJob) -> dict[str, Any]:
    """One Kubeflow TFJob; the operator makes the pods and Services and sets TF_CONFIG itself.

    ``successPolicy: AllWorkers`` ends the job when every worker is done (not just
    worker 0), and ``cleanPodPolicy: Running`` removes only stragglers, so the
    logs of finished pods stay readable.
    """
    def replica(job_name: str, count: int) -> dict[str, Any]:
        meta_labels = {**labels(job), "tensorfleet.io/replica-type": job_name}
        container = _container(job, job_name, name=TFJOB_CONTAINER_NAME, port_name=TFJOB_PORT_NAME, tf_config=None)
        return {"replicas": count, "restartPolicy": RESTART_POLICIES[job.restart],
                "template": {"metadata": {"labels": meta_labels}, "spec": {"containers": [container]}}}

    return {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": _metadata(job, job.name),
            "spec": {"runPolicy": {"backoffLimit": _backoff_limit(job), "cleanPodPolicy": "Running"},
                     "successPolicy": "AllWorkers",
                     "tfReplicaSpecs": {"PS": replica("ps", job.num_ps), "Worker": replica("worker", job.num_workers)}}}


JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOB_INDEX_ANNOTATION = "jobset.sigs.k8s.io/job-index"  # JobSet sets it on every Job and pod it makes
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"  # an Indexed Job's pod's index
TRAINER_GROUP = "trainer.kubeflow.org"
TRAINER_API = f"{TRAINER_GROUP}/v1alpha1"
TRAINER_NODE = "node"  # Trainer's webhook: the trainer's replicated job has a container of this name (and ours)
TRAINER_ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"  # on a replicated job's Job template
TRAINER_ANCESTOR = "trainer"  # ... marks the job Trainer scales to numNodes and applies the TrainJob's trainer to
TRAINER_MAX_ITEMS = 128  # the TrainJob CRD's bound on trainer.command


def _jobset_host(job: K8sJob, replicated: str, job_index: int, pod_index: int) -> str:
    """JobSet's stable pod name, ``NAME-RJOB-JOBINDEX-PODINDEX``, in the JobSet's headless Service ``NAME``."""
    return f"{job.name}-{replicated}-{job_index}-{pod_index}.{job.name}.{job.namespace}.svc:{job.port}"


def jobset_cluster(job: K8sJob) -> ClusterSpec:
    """The cluster as a JobSet's pods see it: ``NAME-ps-0-0.NAME.NAMESPACE.svc`` (replicated job ``ps``, Job
    index 0, pod index 0): one Job of one pod per task."""
    return ClusterSpec.from_dict({kind: [_jobset_host(job, kind, i, 0) for i in range(count)]
                                  for kind, count in (("ps", job.num_ps), ("worker", job.num_workers))})


def trainjob_cluster(job: K8sJob) -> ClusterSpec:
    """The cluster as a TrainJob's pods see it: the ps as in a JobSet, worker i as pod i of the one Job of
    Trainer's ``node`` (``NAME-node-0-i``); Trainer names the JobSet after the TrainJob."""
    return ClusterSpec.from_dict({"ps": [_jobset_host(job, "ps", i, 0) for i in range(job.num_ps)],
                                  "worker": [_jobset_host(job, TRAINER_NODE, 0, i) for i in range(job.num_workers)]})


def _replicated_job(job: K8sJob, kind: str, cluster: ClusterSpec, *, name: str, replicas: int, container: str,
                    index_annotation: str, job_spec: dict[str, Any], restart_policy: str) -> dict[str, Any]:
    """A JobSet replicated job of the tasks of ``kind``: one shared template, so TF_CONFIG holds the cluster only
    and each pod takes its index from ``index_annotation`` (downward API) as ``TENSORFLEET_TASK_INDEX``."""
    main = _container(job, kind, name=container, port_name=PORT_NAME,
                      tf_config=json.dumps({"cluster": cluster.as_dict()}))
    main["env"][1:1] = [
        {"name": TASK_TYPE_ENV, "value": kind},
        {"name": TASK_INDEX_ENV,
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{index_annotation}']"}}}]
    pod_labels = {**labels(job), "tensorfleet.io/replica-type": kind}
    return {"name": name, "replicas": replicas,
            "template": {"metadata": {"labels": dict(pod_labels)},
                         "spec": {**job_spec, "template": {"metadata": {"labels": dict(pod_labels)},
                                                           "spec": {"restartPolicy": restart_policy,
                                                                    "containers": [main]}}}}}


def _one_pod_per_job(job: K8sJob, kind: str, count: int, cluster: ClusterSpec) -> dict[str, Any]:
    """``count`` Jobs of one pod, restarted as in ``manifests`` (in place, ``backoffLimit`` per task)."""
    return _replicated_job(job, kind, cluster, name=kind, replicas=count, container=CONTAINER_NAME,
                           index_annotation=JOB_INDEX_ANNOTATION, restart_policy=RESTART_POLICIES[job.restart],
                           job_spec={"completions": 1, "parallelism": 1, "backoffLimit": _backoff_limit(job)})


def _jobset_spec(replicated: list[dict[str, Any]], workers: str) -> dict[str, Any]:
    """JobSet's headless Service, published before the pods are ready (tasks dial each other while starting);
    success when every Job of ``workers`` has; no restart of the whole set (it would restart every ps empty)."""
    return {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [workers]},
            "replicatedJobs": replicated}


def render_jobset(job: K8sJob) -> dict[str, Any]:
    """One JobSet (Kubeflow Trainer v2's base) with two replicated jobs, ``ps`` and ``worker``: one Job of one pod
    per task. JobSet makes the headless Service (``network``), names the pods stably, and tells each pod its Job
    index (an annotation), which reaches the task as ``TENSORFLEET_TASK_INDEX`` beside the shared TF_CONFIG's
    cluster. Restarts as in ``manifests``: a failed pod is restarted in place up to ``max_restarts`` times (Job
    ``backoffLimit``); a Job that gives up fails the JobSet (``failurePolicy.maxRestarts: 0``, since a restart of
    the whole set would restart every ps empty). The JobSet succeeds when every worker Job has completed.

    Raises:
        ConfigError: the name is too long for the pod names JobSet would make (its webhook would refuse it).
    """
    check_name_length(job.name, "jobset", job.num_ps, job.num_workers)
    cluster = jobset_cluster(job)
    return {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": _metadata(job, job.name),
            "spec": _jobset_spec([_one_pod_per_job(job, "ps", job.num_ps, cluster),
                                  _one_pod_per_job(job, "worker", job.num_workers, cluster)], workers="worker")}


def render_trainjob(job: K8sJob) -> list[dict[str, Any]]:
    """Kubeflow Trainer v2: a ``TrainingRuntime`` whose template is the JobSet, then the ``TrainJob`` naming it
    (Trainer's webhook wants the runtime to exist first).

    Trainer's rules: the replicated job marked as the trainer (``node``) has ``replicas: 1`` and a container named
    ``node``; Trainer scales its one Job to ``trainer.numNodes`` pods and applies the TrainJob's ``trainer``
    (image, command, resources) to that container only, so the workers are the M indexed pods of ``node`` (index:
    the Job's completion index) and the ps keep a replicated job of their own, as in ``jobset``. Since the M
    workers share one Job, a worker's restarts are counted per index (``backoffLimitPerIndex``, which Kubernetes
    allows only with the pod policy ``Never``: a failed worker's pod is replaced, under the same name), and
    ``maxFailedIndexes: 0`` fails the Job as soon as one worker has used them, as one task's Job would.

    Raises:
        ConfigError: the name is too long for the pod names JobSet would make.
    """
    check_name_length(job.name, "trainjob", job.num_ps, job.num_workers)
    cluster = trainjob_cluster(job)
    command = ["python", job.script, *job.script_args]
    if len(command) > TRAINER_MAX_ITEMS:
        raise ConfigError(f"a TrainJob's trainer command holds at most {TRAINER_MAX_ITEMS} items: python, SCRIPT "
                          f"and {TRAINER_MAX_ITEMS - 2} arguments, not {len(job.script_args)}")
    node_restarts = job.max_restarts if job.restart == "on-failure" else 0
    node = _replicated_job(job, "worker", cluster, name=TRAINER_NODE, replicas=1, container=TRAINER_NODE,
                           index_annotation=COMPLETION_INDEX_ANNOTATION, restart_policy="Never",
                           job_spec={"completionMode": "Indexed", "completions": job.num_workers,
                                     "parallelism": job.num_workers, "backoffLimitPerIndex": node_restarts,
                                     "maxFailedIndexes": 0})
    node["template"]["metadata"]["labels"][TRAINER_ANCESTOR_LABEL] = TRAINER_ANCESTOR
    runtime = {"apiVersion": TRAINER_API, "kind": "TrainingRuntime", "metadata": _metadata(job, job.name),
               "spec": {"mlPolicy": {"numNodes": job.num_workers},
                        "template": {"metadata": {"labels": labels(job)},
                                     "spec": _jobset_spec([_one_pod_per_job(job, "ps", job.num_ps, cluster), node],
                                                          workers=TRAINER_NODE)}}}
    trainjob = {"apiVersion": TRAINER_API, "kind": "TrainJob", "metadata": _metadata(job, job.name),
                "spec": {"runtimeRef": {"apiGroup": TRAINER_GROUP, "kind": "TrainingRuntime",
                                        "name": job.name},
                         "trainer": {"numNodes": job.num_workers, "image": job.image, "command": command,
                                     "resourcesPerNode": _resources(job, "worker")}}}
    return [runtime, trainjob]


RENDERERS: dict[str, Callable[[K8sJob], list[dict[str, Any]]]] = {
    "manifests": render_manifests, "tfjob": lambda job: [*_secrets(job), render_tfjob(job)],
    "jobset": lambda job: [*_secrets(job), render_jobset(job)],
    "trainjob": lambda job: [*_secrets(job), *render_trainjob(job)]}


def to_yaml(docs: Sequence[dict[str, Any]]) -> str:
    """Multi-document YAML in the objects' own key order, one long line per TF_CONFIG (no folding)."""
    return yaml.safe_dump_all(list(docs), sort_keys=False, default_flow_style=False, width=2**31 - 1)


# --- command line -----------------------------------------------------------------------------------------------

def _integer(low: int, high: int | None = None) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            valid = f"at least {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: it must be {valid}")
        return value
    return convert


def _choice(options: Sequence[str]) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(f"{text!r} is not valid: use one of {', '.join(options)}")
        return text
    return convert


# flag, environment fallback, converter, default (None: required), metavar, help
_OPTIONS: tuple[tuple[str, str, Callable[[str], Any], Any, str, str], ...] = (
    ("--ps", "TENSORFLEET_PS", _integer(1), None, "N", "number of ps tasks"),
    ("--workers", "TENSORFLEET_WORKERS", _integer(1), None, "M", "number of worker tasks"),
    ("--image", "TENSORFLEET_IMAGE", str, None, "IMG", "container image with python, tensorfleet and SCRIPT"),
    ("--gpus-per-worker", "TENSORFLEET_GPUS_PER_WORKER", _integer(0), 0, "K",
     f"{GPU_RESOURCE} per worker (ps get none)"),
    ("--namespace", "TENSORFLEET_NAMESPACE", str, "default", "NS", "namespace of every object"),
    ("--name", "TENSORFLEET_NAME", str, "tensorfleet", "NAME",
     "job name, the prefix of every object name; what each format derives from it must fit in 63 characters"),
    ("--token-secret", "TENSORFLEET_TOKEN_SECRET", str, "", "SECRET",
     "an existing Secret whose key 'token' holds the job's token (kubectl create secret generic SECRET "
     "--from-file=token=FILE): the output then holds no secret; by default a new token is rendered in a Secret"),
    ("--dense", DENSE_ENV, _choice(DENSE_HOMES), "", "HOME",
     "where the dense parameters live: ps, or allreduce (replicated on the workers, averaged by an all-reduce, "
     "tables on the ps); sets TENSORFLEET_DENSE, the script's --dense default, in every pod; by default the "
     "script's own"),
    ("--restart", "TENSORFLEET_RESTART", _choice(tuple(RESTART_POLICIES)), "on-failure", "POLICY",
     "on-failure (restart a task up to --max-restarts times) or never"),
    ("--max-restarts", "TENSORFLEET_MAX_RESTARTS", _integer(0), 3, "R",
     "restarts per task with on-failure (tfjob: of the whole job, all tasks together: its runPolicy.backoffLimit)"),
    ("--port", "TENSORFLEET_PORT", _integer(1, 65535), 2222, "P", "gRPC port of every task"),
    ("--cpu", "TENSORFLEET_CPU", str, "1", "C", "CPU request of every task"),
    ("--memory", "TENSORFLEET_MEMORY", str, "2Gi", "MEM", "memory request of every task"),
    ("--format", "TENSORFLEET_FORMAT", _choice(FORMATS), "manifests", "FORMAT",
     "manifests (a token Secret, Services, Jobs), jobset (the Secret and one JobSet: Kubeflow Trainer v2's "
     "base), trainjob (the Secret, a Kubeflow Trainer v2 TrainingRuntime and the TrainJob naming it) or tfjob "
     "(the Secret and one TFJob of Kubeflow's v1 training operator, deprecated)"),
)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    """Register ``k8s render`` on the ``tensorfleet`` parser's subcommands."""
    k8s = subcommands.add_parser("k8s", help="render Kubernetes manifests for a training fleet")
    actions = k8s.add_subparsers(dest="k8s_command", required=True, metavar="ACTION")
    render = actions.add_parser(
        "render", usage="tensorfleet k8s render [FLAGS] SCRIPT [-- SCRIPT_ARGS ...]",
        help="write a token Secret, Services and Jobs (or a JobSet, a TrainJob, a TFJob) running SCRIPT as YAML",
        description="Write the Kubernetes objects of a fleet of N ps and M workers, each running SCRIPT (a path "
                    "inside IMG) with its own TF_CONFIG. Arguments after '--' go to SCRIPT. Nothing is sent "
                    "to a cluster: apply the output with 'kubectl apply -f'.",
        epilog="example: tensorfleet k8s render --ps 2 --workers 4 --image repo/train:1 train.py -- --steps 1000 "
               "> fleet.yaml && kubectl apply -f fleet.yaml")
    for flag, env, convert, default, metavar, text in _OPTIONS:
        shown = ", required" if default is None else f", default {default}" if default != "" else ""
        render.add_argument(flag, type=convert, default=None, metavar=metavar, help=f"{text} (env {env}{shown})")
    render.add_argument("-o", "--output", default=None, metavar="FILE", help="write to FILE instead of stdout")
    render.add_argument("script", metavar="SCRIPT", help="the training script every task runs, a path inside IMG")
    render.add_argument("script_args", nargs=argparse.REMAINDER, metavar="SCRIPT_ARGS",
                        help="arguments for SCRIPT, after '--'").required = False  # none is fine


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Each option from its flag, else its TENSORFLEET_* variable, else its default; ConfigError if unset."""
    values: dict[str, Any] = {}
    for flag, env, convert, default, _, _ in _OPTIONS:
        value = getattr(args, _dest(flag))
        if value is None and os.environ.get(env):
            try:
                value = convert(os.environ[env])
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(f"{env}={os.environ[env]!r}: {exc}") from None
        if value is None and default is None:
            raise ConfigError(f"{flag} is required (or set {env})")
        values[_dest(flag)] = default if value is None else value
    return values


def job_from_args(args: argparse.Namespace) -> tuple[K8sJob, str]:
    """The K8sJob and the format named by parsed ``k8s render`` arguments (flags, then environment)."""
    values = _resolve(args)
    if isinstance(values["name"], str):  # the format's limit first: the one the name must meet
        check_name_length(values["name"], values["format"], values["ps"], values["workers"])
    extra = list(args.script_args)  # what the CLI left for the script: its '--' and our misplaced flags handled
    job = K8sJob(name=values["name"], num_ps=values["ps"], num_workers=values["workers"], image=values["image"],
                 script=args.script, script_args=tuple(extra), gpus_per_worker=values["gpus_per_worker"],
                 namespace=values["namespace"], restart=values["restart"], max_restarts=values["max_restarts"],
                 port=values["port"], cpu=values["cpu"], memory=values["memory"],
                 token_secret=values["token_secret"] or None, dense=values["dense"] or None)
    return job, values["format"]


def main(args: argparse.Namespace) -> int:
    """Run ``tensorfleet k8s render``: 0 on success, 2 for a bad option, 1 if the output cannot be written."""
    try:
        job, fmt = job_from_args(args)
    except ConfigError as exc:
        print(f"tensorfleet k8s render: error: {exc}", file=sys.stderr)
        return 2
    text = to_yaml(RENDERERS[fmt](job))
    if job.token_secret is None:
        print(f"tensorfleet k8s render: the output holds the job's new token in the Secret {secret_name(job)!r}: "
              "keep it as private as the token (or create the Secret yourself and pass --token-secret)",
              file=sys.stderr)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        write_file(args.output, text, private=job.token_secret is None)
    except OSError as exc:
        print(f"tensorfleet k8s render: error: cannot write {args.output!r}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


def write_file(path: str | Path, text: str, *, private: bool) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file in the same folder, renamed over it.

    ``private`` (the output holds the token): mode 0600 from the first byte on, never readable by others
    in between; otherwise the usual mode (0666 less the umask), as ``open`` would give.
    """
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            if not private:
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(out.fileno(), 0o666 & ~umask)
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
