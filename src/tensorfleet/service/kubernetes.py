"""The job service's Kubernetes backend: a job becomes the objects ``tensorfleet k8s render`` writes.

``start`` renders the job with ``launch/k8s.py`` (a Secret holding a new token, then a headless
Service and a one-pod ``batch/v1`` Job per task) and creates them in that order, so that every
task's DNS name exists before any pod dials it. With ``format="jobset"`` (``serve --k8s-format
jobset``) it creates the Secret and one JobSet instead, whose controller makes the Service, the
Jobs and the pods; the JobSet's own conditions say when it ended, and its Jobs and pods are found by
the same labels (their index in JobSet's ``job-index`` label). Everything carries ``k8s.labels``, which is how
``observe``, ``stop`` and ``log`` find a job again after a service restart: the backend keeps no
state of its own, only the record and the cluster.

Kubernetes runs the restarts (pod ``OnFailure`` / Job ``backoffLimit``); this backend only reads the
outcome. A job succeeds when every worker Job has completed (each ps exits by itself once the workers
are done), fails when a Job gives up, and is lost when its Jobs were deleted behind the service's back.

The ``kubernetes`` client is imported when a backend is built, not when this module is: the service
must start (with the local backend) where the client is not installed (``pip install tensorfleet[k8s]``).

Example:
    >>> backend = KubernetesBackend(image="repo/train:1", namespace="ml", workspace=Path("/srv/jobs"))
    >>> backend.start(record, jobdir)            # doctest: +SKIP
    >>> backend.observe(record).state            # doctest: +SKIP
    <JobState.RUNNING: 'running'>
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

from tensorfleet.cluster.spec import TASK_INDEX_ENV, TaskSpec
from tensorfleet.dashboard.picture import FleetPicture
from tensorfleet.errors import ConfigError, LaunchError, TensorfleetError, UnavailableError
from tensorfleet.launch import k8s
from tensorfleet.service.backend import Backend, LogChunk, Observed, TaskNotFoundError, TaskView
from tensorfleet.service.store import JobRecord, JobState

REQUEST_TIMEOUT_S = 30.0  # every call to the API server has a deadline: the service's threads never hang
DEFAULT_PORT = 2222  # each task has its own pod IP, so all can share one port
MODE_ENV = "TENSORFLEET_MODE"  # what `tensorfleet launch --sync/--async` sets for the script's default
FORMATS = ("manifests", "jobset")  # what a job becomes: per-task Services and Jobs, or one JobSet
JOBSET_RESOURCE = ("jobset.x-k8s.io", "v1alpha2", "jobsets")  # group, version, plural
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"  # JobSet's label (and annotation) on its Jobs and pods
_NOT_DNS = re.compile(r"[^a-z0-9-]+")


class KubernetesBackend(Backend):
    """Runs jobs as Kubernetes objects in ``namespace``, every pod running ``image``.

    Args:
        image: the container image; it must hold python, tensorfleet and ``workspace`` as its working
            directory, since a job's script is given to the pod relative to ``workspace``.
        namespace: where every object of every job goes.
        workspace: the folder whose files the image holds; jobs' scripts must lie under it.
        kubeconfig, context: which cluster and credentials (kubectl's defaults when None).
        api_client: a ready ``kubernetes.client.ApiClient`` instead (tests, in-cluster configs).

    Raises:
        ConfigError: ``image`` or ``namespace`` cannot be used in a Kubernetes object.
    """

    name = "kubernetes"

    def __init__(self, *, image: str, namespace: str = "default", workspace: Path,
                 kubeconfig: str | None = None, context: str | None = None, api_client: Any = None,
                 format: str = "manifests") -> None:
        # The same checks a job gets at start, done now: a bad setting fails the service, not every job.
        k8s.K8sJob(name="probe", num_ps=1, num_workers=1, image=image, script="probe.py", namespace=namespace)
        if format not in FORMATS:
            raise ConfigError(f"Kubernetes format {format!r} is not valid: use one of {', '.join(FORMATS)}")
        import kubernetes  # here, not at the top: see the module docstring

        self.image = image
        self.namespace = namespace
        self.workspace = Path(workspace)
        self.format = format
        self._client = kubernetes.client
        if api_client is None:
            api_client = kubernetes.config.new_client_from_config(config_file=kubeconfig, context=context)
        self._core = kubernetes.client.CoreV1Api(api_client)
        self._batch = kubernetes.client.BatchV1Api(api_client)
        self._custom = kubernetes.client.CustomObjectsApi(api_client)

    # ----- the Backend protocol

    def start(self, job: JobRecord, jobdir: Path) -> None:
        """Create the job's Secret, Services and Jobs, and keep what was created in ``jobdir/manifests.yaml``.

        Raises:
            ConfigError: the job cannot be rendered (a script outside the workspace, ...).
            LaunchError: the API server refused an object; those already created are deleted again.
        """
        docs = self._render(job)
        _write_private(Path(jobdir) / "manifests.yaml", k8s.to_yaml(docs))
        created: list[dict[str, Any]] = []
        for doc in docs:
            try:
                self._call(self._create, doc)
            except TensorfleetError as exc:
                leftovers = self._delete_all(reversed(created))
                kept = f"; could not delete again: {', '.join(leftovers)}" if leftovers else ""
                raise LaunchError(f"job {job.id}: the {doc['kind']} {doc['metadata']['name']!r} could not be "
                                  f"created in namespace {self.namespace!r}: {exc.message}{kept}") from None
            created.append(doc)

    def observe(self, job: JobRecord) -> Observed:
        """RUNNING, or SUCCEEDED / FAILED / LOST read from the job's Jobs (see the module docstring)."""
        kjob = self._k8s_job(job)
        if self.format == "jobset":
            ended = self._jobset_ended(kjob)
            if ended is not None:
                return ended
        found = self._call(self._batch.list_namespaced_job, self.namespace, label_selector=_selector(k8s.labels(kjob)),
                           _request_timeout=REQUEST_TIMEOUT_S).items
        by_task = {_task_of(item): item for item in found}
        missing = [_task_name(t) for t in kjob.tasks if _task_name(t) not in by_task]
        if missing and self.format == "jobset":  # the JobSet is there: its controller makes (or remakes) them
            return Observed(JobState.RUNNING, None, self._restarts(kjob))
        if missing:
            what = "every Kubernetes Job of the job" if len(missing) == len(kjob.tasks) else \
                f"the Kubernetes Jobs of {', '.join(missing)}"
            return Observed(JobState.LOST, f"{what} disappeared from namespace {self.namespace!r} "
                                           "(deleted outside the service?)")
        restarts = self._restarts(kjob)
        workers = [by_task[_task_name(t)] for t in kjob.tasks if t.job_name == "worker"]
        if all(_condition(item, "Complete") is not None for item in workers):
            return Observed(JobState.SUCCEEDED, "every worker finished", restarts)
        for task in kjob.tasks:  # ps first, as rendered
            failed = _condition(by_task[_task_name(task)], "Failed")
            if failed is not None:
                why = failed.message or failed.reason or "no reason given"
                return Observed(JobState.FAILED, f"task {_task_name(task)} failed: {why}", restarts)
        return Observed(JobState.RUNNING, None, restarts)

    def _jobset_ended(self, kjob: k8s.K8sJob) -> Observed | None:
        """LOST when the JobSet is gone, SUCCEEDED or FAILED when its controller says it ended, else None."""
        try:
            jobset = self._call(self._custom.get_namespaced_custom_object, *JOBSET_RESOURCE[:2], self.namespace,
                                JOBSET_RESOURCE[2], kjob.name, _request_timeout=REQUEST_TIMEOUT_S)
        except _NotFound:
            return Observed(JobState.LOST, f"the JobSet {kjob.name!r} disappeared from namespace "
                                           f"{self.namespace!r} (deleted outside the service?)")
        for item in (jobset.get("status") or {}).get("conditions") or []:
            if item.get("status") != "True":
                continue
            if item.get("type") == "Completed":
                return Observed(JobState.SUCCEEDED, "every worker finished", self._restarts(kjob))
            if item.get("type") == "Failed":
                why = item.get("message") or item.get("reason") or "no reason given"
                return Observed(JobState.FAILED, f"the JobSet failed: {why}", self._restarts(kjob))
        return None

    def stop(self, job: JobRecord) -> None:
        """Delete the job's Jobs (their pods with them), Services and Secret; what is already gone is fine.

        Raises:
            LaunchError: an object could not be deleted (the others were still tried).
        """
        leftovers = self._delete_all(reversed(self._render(job)))  # the reverse of start: Jobs first, Secret last
        if leftovers:
            raise LaunchError(f"job {job.id}: could not delete {', '.join(leftovers)} in namespace "
                              f"{self.namespace!r}")

    def scale(self, job: JobRecord, workers: int) -> None:
        """Refused: each worker is a Job wired into every other task's TF_CONFIG, which a pod cannot change."""
        raise ConfigError(f"job {job.id} runs on Kubernetes: scaling is supported on the local backend only")

    def tasks(self, job: JobRecord) -> list[TaskView]:
        """Each task's command and plain environment, as rendered (the token, from its Secret, is left out)."""
        views = []
        for task, container in _containers(self._render(job)):
            env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
            if TASK_INDEX_ENV in {e["name"] for e in container["env"]}:  # a JobSet's: the index from the pod's
                env[TASK_INDEX_ENV] = str(task.index)
            role = "chief" if (task.job_name, task.index) == ("worker", 0) else task.job_name
            views.append(TaskView(_task_name(task), role, list(container["command"]), env))
        return views

    def log(self, job: JobRecord, task: str, offset: int = 0, limit: int = 1 << 20) -> LogChunk:
        """``task``'s log from its newest pod (a task restarted by a new pod starts a new log); empty until
        the pod runs.

        Raises:
            TaskNotFoundError: the job has no task ``task`` (NOT_FOUND).
        """
        kjob = self._k8s_job(job)
        spec = _parse_task(task, kjob)
        selector = k8s.labels(kjob, spec) if self.format == "manifests" else \
            {**k8s.labels(kjob), "tensorfleet.io/replica-type": spec.job_name, JOB_INDEX_LABEL: str(spec.index)}
        pods = self._call(self._core.list_namespaced_pod, self.namespace,
                          label_selector=_selector(selector), _request_timeout=REQUEST_TIMEOUT_S).items
        if not pods:
            return LogChunk("", offset)
        newest = max(pods, key=lambda pod: (pod.metadata.creation_timestamp is not None,
                                            pod.metadata.creation_timestamp or 0))
        try:
            response = self._call(self._core.read_namespaced_pod_log, newest.metadata.name, self.namespace,
                                  container=k8s.CONTAINER_NAME, limit_bytes=offset + limit,
                                  _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)
        except _WaitingToStart:
            return LogChunk("", offset)
        data = _read(response)[offset:offset + limit]
        return LogChunk(data.decode("utf-8", errors="replace"), offset + len(data))

    def picture(self, job: JobRecord) -> FleetPicture | None:
        """None: the pods' Status RPC is not reachable from outside the cluster."""
        return None

    # ----- helpers

    def _k8s_job(self, job: JobRecord) -> k8s.K8sJob:
        """The job as ``k8s.py`` renders it. Names depend only on the record, so every call finds the same
        objects; the token is new each time and used only by ``start`` (the others never read it)."""
        config = job.job_config
        return k8s.K8sJob(name=kubernetes_name(job.id, job.name, workers=config.workers, ps=config.ps,
                                               format=self.format),
                          num_ps=config.ps, num_workers=config.workers, image=self.image,
                          script=self._script(config.script), script_args=tuple(config.args),
                          gpus_per_worker=config.gpus_per_worker, namespace=self.namespace,
                          restart=config.restart, max_restarts=config.max_restarts,
                          port=config.port or DEFAULT_PORT, dense=config.dense)

    def _render(self, job: JobRecord) -> list[dict[str, Any]]:
        """The job's objects, each Job's pod with the job's own environment and mode added (where dense parameters
        live is the renderer's own)."""
        config = job.job_config
        docs = k8s.RENDERERS[self.format](self._k8s_job(job))
        extra = dict(config.env)
        if config.mode is not None:
            extra[MODE_ENV] = config.mode
        for _, container in _containers(docs, each_task=False):
            ours = {e["name"] for e in container["env"]}  # TF_CONFIG, the token: the renderer's, not the user's
            container["env"][-1:-1] = [{"name": k, "value": v} for k, v in extra.items() if k not in ours]
        return docs

    def _script(self, script: str) -> str:
        """``script`` relative to the workspace, the image's working directory."""
        path = Path(script)
        if not path.is_absolute():
            return path.as_posix()
        for base, target in ((self.workspace, path), (self.workspace.resolve(), path.resolve())):
            if target.is_relative_to(base):
                return target.relative_to(base).as_posix()
        raise ConfigError(f"script {script!r} is outside the workspace {str(self.workspace)!r}, which is all "
                          "the image holds: put the script under the workspace")

    def _create(self, doc: dict[str, Any]) -> Any:
        body = _quantities_as_text(doc)
        if doc["kind"] == "JobSet":
            return self._custom.create_namespaced_custom_object(*JOBSET_RESOURCE[:2], self.namespace,
                                                                JOBSET_RESOURCE[2], body,
                                                                _request_timeout=REQUEST_TIMEOUT_S)
        if doc["kind"] == "Job":
            return self._batch.create_namespaced_job(self.namespace, body, _request_timeout=REQUEST_TIMEOUT_S)
        create = {"Secret": self._core.create_namespaced_secret, "Service": self._core.create_namespaced_service}
        return create[doc["kind"]](self.namespace, body, _request_timeout=REQUEST_TIMEOUT_S)

    def _delete(self, doc: dict[str, Any]) -> None:
        # The answer (the object or a Status, depending on the kind and the server) is not read.
        name, options = doc["metadata"]["name"], {"_request_timeout": REQUEST_TIMEOUT_S, "_preload_content": False}
        if doc["kind"] == "JobSet":  # its Jobs, their pods and its Service go with it
            response = self._custom.delete_namespaced_custom_object(
                *JOBSET_RESOURCE[:2], self.namespace, JOBSET_RESOURCE[2], name, propagation_policy="Background",
                **options)
        elif doc["kind"] == "Job":  # Background: the garbage collector removes the Job's pods too
            response = self._batch.delete_namespaced_job(name, self.namespace, propagation_policy="Background",
                                                         **options)
        elif doc["kind"] == "Service":
            response = self._core.delete_namespaced_service(name, self.namespace, **options)
        else:
            response = self._core.delete_namespaced_secret(name, self.namespace, **options)
        _read(response)

    def _delete_all(self, docs: Iterable[dict[str, Any]]) -> list[str]:
        """Delete each object (gone already is fine); the ones that could not be, with why."""
        leftovers = []
        for doc in docs:
            try:
                self._call(self._delete, doc)
            except _NotFound:
                pass
            except TensorfleetError as exc:
                leftovers.append(f"{doc['kind']} {doc['metadata']['name']!r} ({exc.message})")
        return leftovers

    def _restarts(self, kjob: k8s.K8sJob) -> int:
        """Container restarts in place (OnFailure) plus replacement pods (Never), over every task's pods."""
        pods = self._call(self._core.list_namespaced_pod, self.namespace, label_selector=_selector(k8s.labels(kjob)),
                          _request_timeout=REQUEST_TIMEOUT_S).items
        per_task: dict[str, int] = {}
        in_place = 0
        for pod in pods:
            per_task[_task_of(pod)] = per_task.get(_task_of(pod), 0) + 1
            in_place += sum(s.restart_count or 0 for s in (pod.status.container_statuses or [])) if pod.status else 0
        return in_place + sum(count - 1 for count in per_task.values())

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` with the client's errors turned into tensorfleet's."""
        import urllib3  # a dependency of the kubernetes client, present whenever a backend exists

        try:
            return method(*args, **kwargs)
        except self._client.ApiException as exc:
            raise _api_error(exc) from None
        except urllib3.exceptions.HTTPError as exc:
            raise UnavailableError(f"the Kubernetes API server cannot be reached: {exc}") from None


class _NotFound(LaunchError):
    """The API answered 404."""


class _WaitingToStart(LaunchError):
    """The API answered 400 for a pod log: the container has not started yet."""


def _api_error(exc: Any) -> TensorfleetError:
    """The API server's own message (its Status body), as the error a caller can act on."""
    message = exc.reason or "no reason given"
    try:
        body = json.loads(exc.body or "")
        message = body.get("message") or message
    except (ValueError, AttributeError):
        pass
    text = f"Kubernetes API said {exc.status}: {message}"
    if exc.status == 404:
        return _NotFound(text)
    if exc.status == 400 and "waiting to start" in message:
        return _WaitingToStart(text)
    if exc.status is None or exc.status == 429 or exc.status >= 500:
        return UnavailableError(text)
    return LaunchError(text)


def kubernetes_name(job_id: int, name: str, *, workers: int, ps: int, format: str = "manifests") -> str:
    """``tf-<id>-<name>``, DNS-safe and short enough for every name ``k8s.py`` derives from it in ``format``
    (``-worker-<M-1>``; a JobSet's pod names, ``-worker-<M-1>-0-xxxxx``, that its webhook checks).

    Example:
        >>> kubernetes_name(7, "MNIST_mlp.v2", workers=2, ps=1)
        'tf-7-mnist-mlp-v2'
    """
    prefix = f"tf-{job_id}"
    room = k8s.max_name_length(format, ps, workers)
    tail = _NOT_DNS.sub("-", name.lower()).strip("-")
    full = f"{prefix}-{tail}" if tail else prefix
    return full[:max(room, len(prefix))].rstrip("-")


def _task_name(task: TaskSpec) -> str:
    return f"{task.job_name}:{task.index}"


def _task_of(item: Any) -> str:
    """``worker:1`` from an object's labels (its name when the labels were changed by hand); a JobSet's Jobs and
    pods have their index in JobSet's label."""
    labels = item.metadata.labels or {}
    kind = labels.get("tensorfleet.io/replica-type")
    index = labels.get("tensorfleet.io/replica-index") or labels.get(JOB_INDEX_LABEL)
    return f"{kind}:{index}" if kind and index else item.metadata.name


def _containers(docs: list[dict[str, Any]], *, each_task: bool = True) -> list[tuple[TaskSpec, dict[str, Any]]]:
    """Each task's container in rendered ``docs``: a Job's, or a JobSet replicated job's (the same for each of its
    replicas; once for all of them unless ``each_task``), with the task (the first replica's when not
    ``each_task``)."""
    found = []
    for doc in docs:
        if doc["kind"] == "Job":
            labels = doc["metadata"]["labels"]
            task = TaskSpec(labels["tensorfleet.io/replica-type"], int(labels["tensorfleet.io/replica-index"]))
            found.append((task, doc["spec"]["template"]["spec"]["containers"][0]))
        elif doc["kind"] == "JobSet":
            for replicated in doc["spec"]["replicatedJobs"]:
                container = replicated["template"]["spec"]["template"]["spec"]["containers"][0]
                for index in range(replicated["replicas"] if each_task else 1):
                    found.append((TaskSpec(replicated["name"], index), container))
    return found


def _parse_task(task: str, kjob: k8s.K8sJob) -> TaskSpec:
    names = {_task_name(t): t for t in kjob.tasks}
    if task not in names:
        raise TaskNotFoundError(f"job has no task {task!r}; its tasks are {', '.join(names)}")
    return names[task]


def _condition(item: Any, kind: str) -> Any:
    """The Job's condition ``kind`` ("Complete", "Failed") when it holds, else None."""
    for condition in (item.status.conditions or []) if item.status else []:
        if condition.type == kind and condition.status == "True":
            return condition
    return None


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in labels.items())


def _quantities_as_text(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy with resource quantities as strings: the rendered ``nvidia.com/gpu: 1`` is a valid
    quantity in YAML, but the client's models accept only text."""
    doc = copy.deepcopy(doc)
    if doc["kind"] == "Job":
        for container in doc["spec"]["template"]["spec"]["containers"]:
            for part in container.get("resources", {}).values():
                part.update({key: str(value) for key, value in part.items()})
    return doc


def _read(response: Any) -> bytes:
    """The body of an unparsed (``_preload_content=False``) response, its connection back in the pool."""
    try:
        return response.data
    finally:
        response.release_conn()


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by its owner only: the manifests hold the job's token."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
