"""The job service's Kubernetes backend against a recording stand-in for the API server on 127.0.0.1.

The real ``kubernetes`` client sends real HTTP requests; the stand-in records each one (method, path,
query, JSON body) and answers as the API server would, so the tests check both what the backend asks
of Kubernetes (every created object validated against the API schema) and how it reads the answers.
"""

from __future__ import annotations

import dataclasses
import json
import re
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

import jsonschema
import kubernetes
import kubernetes_validate
import pytest
import yaml

from tensorfleet.cluster.spec import TaskSpec, from_tf_config
from tensorfleet.errors import ConfigError, LaunchError, TensorfleetError, UnavailableError
from tensorfleet.launch.config import JobConfig
from tensorfleet.service.backend import LogChunk
from tensorfleet.service.kubernetes import KubernetesBackend, kubernetes_name
from tensorfleet.service.store import JobRecord, JobState
from tensorfleet.wire.auth import TOKEN_ENV

K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
NS = "ml"
NAME = "tf-7-mnist"  # job 7, named mnist
TASKS = ("ps:0", "worker:0", "worker:1")
JOBS_PATH = f"/apis/batch/v1/namespaces/{NS}/jobs"
PODS_PATH = f"/api/v1/namespaces/{NS}/pods"
SERVICES_PATH = f"/api/v1/namespaces/{NS}/services"
SECRETS_PATH = f"/api/v1/namespaces/{NS}/secrets"
JOB_SELECTOR = f"app.kubernetes.io/name=tensorfleet,app.kubernetes.io/instance={NAME}"
JOBSETS_PATH = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"


# ----- the stand-in API server

@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Any  # parsed JSON, or None


@dataclass
class FakeApiServer:
    """Records requests; answers from ``jobs``, ``pods`` and ``logs``; ``fail`` picks requests to refuse."""

    url: str = ""
    requests: list[Request] = field(default_factory=list)
    jobs: list[dict] = field(default_factory=list)
    pods: list[dict] = field(default_factory=list)
    logs: dict[str, bytes] = field(default_factory=dict)  # pod name -> its log
    jobsets: dict[str, dict] = field(default_factory=dict)  # name -> the JobSet as the API answers it
    fail: Callable[[Request], tuple[int, str] | None] = lambda request: None  # (status, message) to refuse with

    def of(self, method: str, path: str | None = None) -> list[Request]:
        return [r for r in self.requests if r.method == method and (path is None or r.path == path)]

    def answer(self, request: Request) -> tuple[int, str, bytes]:
        refused = self.fail(request)
        if refused is not None:
            status, message = refused
            failure = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": status}
            return status, "application/json", json.dumps(failure).encode()
        if request.method == "POST":  # a create: the object back, as stored
            return 201, "application/json", json.dumps(request.body).encode()
        if request.method == "DELETE":
            return 200, "application/json", b'{"kind": "Status", "apiVersion": "v1", "status": "Success"}'
        if request.path.startswith(f"{JOBSETS_PATH}/"):  # a GET of one JobSet
            found = self.jobsets.get(request.path.rsplit("/", 1)[1])
            if found is None:
                gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "not found", "code": 404}
                return 404, "application/json", json.dumps(gone).encode()
            return 200, "application/json", json.dumps(found).encode()
        if request.path.endswith("/log"):
            pod = request.path.split("/")[-2]
            data = self.logs[pod][:int(request.query.get("limitBytes", 1 << 62))]
            return 200, "text/plain", data
        items = {JOBS_PATH: ("JobList", "batch/v1", self.jobs), PODS_PATH: ("PodList", "v1", self.pods)}
        kind, version, objects = items[request.path]
        wanted = dict(pair.split("=") for pair in request.query.get("labelSelector", "").split(",") if pair)
        selected = [o for o in objects if wanted.items() <= o["metadata"].get("labels", {}).items()]
        return 200, "application/json", json.dumps(
            {"kind": kind, "apiVersion": version, "metadata": {}, "items": selected}).encode()


@pytest.fixture
def api():
    server = FakeApiServer()

    class Handler(BaseHTTPRequestHandler):
        def handle_one(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            url = urlsplit(self.path)
            request = Request(self.command, url.path, {k: v[-1] for k, v in parse_qs(url.query).items()},
                              json.loads(raw) if raw else None)
            server.requests.append(request)
            status, content_type, data = server.answer(request)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = handle_one

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{httpd.server_port}"
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "ws" / "train").mkdir(parents=True)
    (tmp_path / "ws" / "train" / "mnist.py").write_text("print('training')\n")
    return tmp_path / "ws"


@pytest.fixture
def backend(api, workspace):
    configuration = kubernetes.client.Configuration()
    configuration.host = api.url
    client = kubernetes.client.ApiClient(configuration)
    yield KubernetesBackend(image="repo/train:1", namespace=NS, workspace=workspace, api_client=client)
    client.close()


def make_record(workspace: Path, **config: Any) -> JobRecord:
    fields = dict(script=str(workspace / "train" / "mnist.py"), args=["--steps", "5"], ps=1, workers=2,
                  gpus_per_worker=1, mode="sync", env={"OMP_NUM_THREADS": "1", "TF_CONFIG": "not mine"},
                  name="mnist")
    fields.update(config)
    job_config = JobConfig(**fields)
    return JobRecord(id=7, name=job_config.job_name, owner="ann", config=dataclasses.asdict(job_config),
                     state=JobState.RUNNING, created_at=0.0, updated_at=0.0, backend="kubernetes")


def job_object(task: str, *conditions: dict, name: str = NAME) -> dict:
    """A Job as the API lists it: ``task``'s labels and the given status conditions."""
    kind, index = task.split(":")
    labels = {"app.kubernetes.io/name": "tensorfleet", "app.kubernetes.io/instance": name,
              "tensorfleet.io/replica-type": kind, "tensorfleet.io/replica-index": index}
    return {"metadata": {"name": f"{name}-{kind}-{index}", "namespace": NS, "labels": labels},
            "status": {"conditions": list(conditions)}}


def condition(kind: str, message: str = "") -> dict:
    return {"type": kind, "status": "True", "message": message}


def pod_object(task: str, name: str, created: str, restarts: int = 0) -> dict:
    labels = job_object(task)["metadata"]["labels"]
    return {"metadata": {"name": name, "namespace": NS, "labels": labels, "creationTimestamp": created},
            "status": {"containerStatuses": [{"name": "tensorfleet", "restartCount": restarts, "image": "i",
                                              "imageID": "", "ready": True}]}}


# ----- start

def test_start_creates_the_secret_then_services_then_jobs_that_validate(api, backend, workspace, tmp_path):
    backend.start(make_record(workspace), tmp_path)

    created = [(r.path, r.body["metadata"]["name"]) for r in api.requests]
    assert [r.method for r in api.requests] == ["POST"] * 7
    assert created == [(SECRETS_PATH, f"{NAME}-token")] + [
        (SERVICES_PATH, f"{NAME}-{t.replace(':', '-')}") for t in TASKS] + [
        (JOBS_PATH, f"{NAME}-{t.replace(':', '-')}") for t in TASKS]
    for request in api.requests:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(request.body, version, strict=True)
        assert request.body["metadata"]["namespace"] == NS
        assert request.body["metadata"]["labels"]["app.kubernetes.io/instance"] == NAME

    token = api.requests[0].body["stringData"]["token"]
    jobs = [r.body for r in api.of("POST", JOBS_PATH)]
    cluster = None
    for job, task in zip(jobs, TASKS):
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert token not in json.dumps(job)
        assert container["image"] == "repo/train:1"
        assert container["command"] == ["python", "train/mnist.py", "--steps", "5"]  # relative to the workspace
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        assert env[TOKEN_ENV] == {"secretKeyRef": {"name": f"{NAME}-token", "key": "token"}}
        assert env["OMP_NUM_THREADS"] == "1" and env["TENSORFLEET_MODE"] == "sync"
        assert len(container["env"]) == len(env)  # the user's TF_CONFIG did not add a second one
        cluster, me = from_tf_config(env["TF_CONFIG"])
        assert f"{me.job_name}:{me.index}" == task
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == ("1" if task.startswith("worker") else None)
        assert job["spec"]["backoffLimit"] == 3
    assert cluster.task_address("worker", 1) == f"{NAME}-worker-1.{NS}.svc:2222"

    manifests = tmp_path / "manifests.yaml"
    assert [d["metadata"]["name"] for d in yaml.safe_load_all(manifests.read_text())] == [n for _, n in created]
    assert token in manifests.read_text()
    assert stat.S_IMODE(manifests.stat().st_mode) == 0o600  # it holds the token


def test_a_refused_create_deletes_what_was_created_and_says_why(api, backend, workspace, tmp_path):
    api.fail = lambda r: (409, 'jobs.batch "tf-7-mnist-worker-0" already exists') \
        if r.method == "POST" and r.path == JOBS_PATH and r.body["metadata"]["name"] == f"{NAME}-worker-0" else None
    with pytest.raises(LaunchError, match=r"job 7: the Job 'tf-7-mnist-worker-0' could not be created .*409.*"
                                          r"already exists"):
        backend.start(make_record(workspace), tmp_path)

    deleted = [(r.path, r.query) for r in api.of("DELETE")]
    # newest first, and never the object that was refused (it may be someone else's)
    assert deleted == [(f"{JOBS_PATH}/{NAME}-ps-0", {"propagationPolicy": "Background"})] + [
        (f"{SERVICES_PATH}/{NAME}-{t.replace(':', '-')}", {}) for t in reversed(TASKS)] + [
        (f"{SECRETS_PATH}/{NAME}-token", {})]


def test_a_refused_first_create_deletes_nothing(api, backend, workspace, tmp_path):
    api.fail = lambda r: (403, 'secrets is forbidden: User "ann" cannot create') if r.method == "POST" else None
    with pytest.raises(LaunchError, match="Secret 'tf-7-mnist-token'.*403.*forbidden"):
        backend.start(make_record(workspace), tmp_path)
    assert api.of("DELETE") == [] and len(api.requests) == 1


def test_a_script_outside_the_workspace_is_refused_before_any_request(api, backend, workspace, tmp_path):
    outside = tmp_path / "elsewhere.py"
    outside.write_text("")
    with pytest.raises(ConfigError, match="outside the workspace"):
        backend.start(make_record(workspace, script=str(outside)), tmp_path)
    assert api.requests == []


@pytest.mark.parametrize("job_id, name, workers", [(7, "MNIST_mlp.v2", 2), (123456, "x" * 80, 1000), (3, "__", 1)])
def test_kubernetes_names_are_dns_labels_within_the_limit(job_id, name, workers):
    short = kubernetes_name(job_id, name, workers=workers, ps=2)
    assert short.startswith(f"tf-{job_id}")
    longest = f"{short}-worker-{workers - 1}"
    assert len(longest) <= 63  # a Service name and a label value
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", longest)


# ----- observe

def test_observe_lists_the_jobs_by_label_and_reports_running_with_restarts(api, backend, workspace):
    api.jobs = [job_object(t) for t in TASKS] + [job_object("worker:0", name="tf-8-other")]
    api.pods = [pod_object("ps:0", "p0", "2026-01-01T00:00:00Z", restarts=2),
                pod_object("worker:1", "w1a", "2026-01-01T00:00:00Z"),
                pod_object("worker:1", "w1b", "2026-01-01T00:01:00Z", restarts=1)]
    observed = backend.observe(make_record(workspace))
    assert observed.state is JobState.RUNNING
    assert observed.restarts == 2 + 1 + 1  # in place, plus worker:1's replacement pod
    (listed,) = api.of("GET", JOBS_PATH)
    assert listed.query["labelSelector"] == JOB_SELECTOR


def test_observe_succeeds_when_every_worker_completed_while_the_ps_still_runs(api, backend, workspace):
    api.jobs = [job_object("ps:0"), job_object("worker:0", condition("Complete")),
                job_object("worker:1", condition("Complete"))]
    assert backend.observe(make_record(workspace)).state is JobState.SUCCEEDED
    api.jobs[1] = job_object("worker:0")  # one worker still running: not yet
    assert backend.observe(make_record(workspace)).state is JobState.RUNNING


def test_observe_fails_naming_the_task_and_the_jobs_message(api, backend, workspace):
    api.jobs = [job_object("ps:0"), job_object("worker:0", condition("Complete")),
                job_object("worker:1", condition("Failed", "Job has reached the specified backoff limit"))]
    observed = backend.observe(make_record(workspace))
    assert observed.state is JobState.FAILED
    assert observed.reason == "task worker:1 failed: Job has reached the specified backoff limit"


@pytest.mark.parametrize("left, words", [((), "every Kubernetes Job of the job disappeared"),
                                         (("ps:0", "worker:0"), "the Kubernetes Jobs of worker:1 disappeared")])
def test_observe_reports_lost_when_jobs_were_deleted_behind_its_back(api, backend, workspace, left, words):
    api.jobs = [job_object(t) for t in left]
    observed = backend.observe(make_record(workspace))
    assert observed.state is JobState.LOST
    assert words in observed.reason and repr(NS) in observed.reason


def test_an_unreachable_or_failing_api_server_is_a_recoverable_error(api, backend, workspace):
    api.fail = lambda r: (503, "etcdserver: leader changed")
    with pytest.raises(UnavailableError, match="503: etcdserver: leader changed") as caught:
        backend.observe(make_record(workspace))
    assert caught.value.recoverable


# ----- stop, scale

def test_stop_deletes_jobs_with_their_pods_then_services_and_secret(api, backend, workspace):
    gone = f"{SERVICES_PATH}/{NAME}-ps-0"
    api.fail = lambda r: (404, "not found") if r.path == gone else None  # already deleted: fine
    backend.stop(make_record(workspace))
    assert [r.method for r in api.requests] == ["DELETE"] * 7
    assert [(r.path, r.query) for r in api.requests] == [  # the reverse of start: pods go before their names
        (f"{JOBS_PATH}/{NAME}-{t.replace(':', '-')}", {"propagationPolicy": "Background"}) for t in reversed(TASKS)] + [
        (f"{SERVICES_PATH}/{NAME}-{t.replace(':', '-')}", {}) for t in reversed(TASKS)] + [
        (f"{SECRETS_PATH}/{NAME}-token", {})]


def test_stop_tries_every_object_and_names_those_it_could_not_delete(api, backend, workspace):
    api.fail = lambda r: (403, "forbidden") if r.path.startswith(JOBS_PATH) else None
    with pytest.raises(LaunchError, match=r"could not delete Job 'tf-7-mnist-worker-1' \(.*403: forbidden\), "):
        backend.stop(make_record(workspace))
    assert len(api.of("DELETE")) == 7


def test_scale_is_refused(api, backend, workspace):
    with pytest.raises(ConfigError, match="local backend only"):
        backend.scale(make_record(workspace), 4)
    assert api.requests == []


# ----- tasks, log

def test_tasks_show_command_and_environment_without_the_token(api, backend, workspace):
    views = backend.tasks(make_record(workspace))
    assert [(v.name, v.role) for v in views] == [("ps:0", "ps"), ("worker:0", "chief"), ("worker:1", "worker")]
    for view in views:
        assert view.command == ["python", "train/mnist.py", "--steps", "5"]
        assert TOKEN_ENV not in view.env
        kind, index = view.name.split(":")
        assert from_tf_config(view.env["TF_CONFIG"])[1] == TaskSpec(kind, int(index))
        assert view.env["OMP_NUM_THREADS"] == "1"
    assert api.requests == []


def test_log_reads_the_newest_pod_of_the_task_from_the_offset(api, backend, workspace):
    api.pods = [pod_object("worker:1", "w1-old", "2026-01-01T00:00:00Z"),
                pod_object("worker:1", "w1-new", "2026-01-01T00:05:00Z"),
                pod_object("worker:0", "w0", "2026-01-01T00:09:00Z")]
    api.logs = {"w1-new": "hello\nwörld\n".encode()}
    chunk = backend.log(make_record(workspace), "worker:1", offset=6, limit=4)
    assert (chunk.text, chunk.next_offset) == ("wör", 10)
    listed, read = api.requests
    assert listed.path == PODS_PATH
    assert listed.query["labelSelector"] == (f"{JOB_SELECTOR},tensorfleet.io/replica-type=worker,"
                                             "tensorfleet.io/replica-index=1")
    assert read.path == f"{PODS_PATH}/w1-new/log"
    assert read.query == {"container": "tensorfleet", "limitBytes": "10"}
    rest = backend.log(make_record(workspace), "worker:1", offset=chunk.next_offset)
    assert (rest.text, rest.next_offset) == ("ld\n", 13)


def test_log_is_empty_until_the_pod_exists_and_its_container_starts(api, backend, workspace):
    assert backend.log(make_record(workspace), "ps:0", offset=5) == LogChunk("", 5)  # no pod yet
    api.pods = [pod_object("ps:0", "p0", "2026-01-01T00:00:00Z")]
    api.fail = lambda r: (400, 'container "tensorfleet" in pod "p0" is waiting to start: ContainerCreating') \
        if r.path.endswith("/log") else None
    chunk = backend.log(make_record(workspace), "ps:0")
    assert (chunk.text, chunk.next_offset) == ("", 0)


@pytest.mark.parametrize("task", ["worker:2", "ps:1", "chief:0", "worker", "/job:worker/task:0"])
def test_log_of_an_unknown_task_is_not_found(api, backend, workspace, task):
    with pytest.raises(TensorfleetError, match="no task") as caught:
        backend.log(make_record(workspace), task)
    assert caught.value.code == "NOT_FOUND"
    assert api.requests == []


def test_picture_is_none(backend, workspace):
    assert backend.picture(make_record(workspace)) is None


# ----- construction

def test_a_kubeconfig_and_context_pick_the_cluster(api, workspace, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "wrong",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}},
                     {"name": "nowhere", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "ann", "user": {"token": "abc"}}],
        "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "ann"}},
                     {"name": "wrong", "context": {"cluster": "nowhere", "user": "ann"}}]}))
    backend = KubernetesBackend(image="repo/train:1", namespace=NS, workspace=workspace,
                                kubeconfig=str(kubeconfig), context="test")
    api.jobs = [job_object(t) for t in TASKS]
    assert backend.observe(make_record(workspace)).state is JobState.RUNNING
    assert api.of("GET", JOBS_PATH)


@pytest.mark.parametrize("settings, words", [({"image": "has space"}, "image"), ({"namespace": "Bad_NS"}, "namespace")])
def test_bad_settings_fail_when_the_backend_is_built(workspace, settings, words):
    with pytest.raises(ConfigError, match=words):
        KubernetesBackend(**{"image": "repo/train:1", "workspace": workspace, "api_client": object(), **settings})


def test_the_module_imports_without_loading_the_kubernetes_client():
    """The service must start where the client is not installed: only building a backend imports it."""
    code = ("import sys, tensorfleet.service.kubernetes; "
            "assert 'kubernetes' not in sys.modules, 'imported at module level'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# ----- through the job service: submitted, created, observed, stopped


def test_the_job_service_runs_a_kubernetes_job_from_submit_to_success_and_stops_another(api, backend, workspace,
                                                                                      tmp_path):
    from tensorfleet.service.accounts import User
    from tensorfleet.service.jobs import Capacity, JobService
    from tensorfleet.service.store import JobStore

    with JobStore(tmp_path / "jobs.sqlite") as store:
        service = JobService(store, {"kubernetes": backend}, home=tmp_path / "home", workspace=workspace,
                             capacity=Capacity(1, 0))
        ann = User("ann", False)
        first = service.submit(ann, {"script": "train/mnist.py", "workers": 2, "mode": "async"},
                               backend="kubernetes").id
        second = service.submit(ann, {"script": "train/mnist.py", "workers": 2}, backend="kubernetes").id
        name = f"tf-{first}-mnist"
        api.jobs = [job_object(t, name=name) for t in TASKS]
        service.tick()  # not bound by the machine's cores: both start
        assert [r.body["metadata"]["name"] for r in api.of("POST", JOBS_PATH)] == [
            f"tf-{j}-mnist-{t.replace(':', '-')}" for j in (first, second) for t in TASKS]
        service.tick()
        assert service.get(first).state is JobState.RUNNING
        api.jobs = [job_object("ps:0", name=name)] + [job_object(t, condition("Complete"), name=name)
                                                     for t in TASKS[1:]]
        service.tick()
        done = service.get(first)
        assert (done.state, done.reason) == (JobState.SUCCEEDED, "every worker finished")

        assert service.get(second).state is JobState.LOST  # its Jobs are not in the (stand-in) cluster
        third = service.submit(ann, {"script": "train/mnist.py"}, backend="kubernetes").id
        service.tick()
        stopped = service.stop(ann, third)  # still starting: stopped all the same, its objects deleted
        assert (stopped.state, stopped.reason) == (JobState.STOPPED, "stopped by ann")
        assert {r.path for r in api.of("DELETE")} >= {f"{JOBS_PATH}/tf-{third}-mnist-worker-0",
                                                      f"{SECRETS_PATH}/tf-{third}-mnist-token"}


# ----- the JobSet format (serve --k8s-format jobset)

@pytest.fixture
def jobset_backend(api, workspace):
    configuration = kubernetes.client.Configuration()
    configuration.host = api.url
    client = kubernetes.client.ApiClient(configuration)
    yield KubernetesBackend(image="repo/train:1", namespace=NS, workspace=workspace, api_client=client,
                            format="jobset")
    client.close()


def jobset_child(task: str, *conditions: dict) -> dict:
    """A Job (or pod) the JobSet controller made: our template's labels and JobSet's job index."""
    made = job_object(task, *conditions)
    labels = made["metadata"]["labels"]
    labels["jobset.sigs.k8s.io/job-index"] = labels.pop("tensorfleet.io/replica-index")
    return made


def test_a_hybrid_job_tells_every_pod_where_dense_parameters_live_once(api, backend, workspace, tmp_path):
    backend.start(make_record(workspace, dense="allreduce"), tmp_path)
    for job in (r.body for r in api.of("POST", JOBS_PATH)):
        (container,) = job["spec"]["template"]["spec"]["containers"]
        dense = [e for e in container["env"] if e["name"] == "TENSORFLEET_DENSE"]
        assert dense == [{"name": "TENSORFLEET_DENSE", "value": "allreduce"}]


def test_a_jobset_job_is_the_secret_and_one_jobset_valid_for_the_pinned_crd(api, jobset_backend, workspace, tmp_path):
    jobset_backend.start(make_record(workspace), tmp_path)
    assert [(r.method, r.path) for r in api.requests] == [("POST", SECRETS_PATH), ("POST", JOBSETS_PATH)]
    token = api.requests[0].body["stringData"]["token"]
    jobset = api.requests[1].body
    assert token not in json.dumps(jobset) and jobset["metadata"]["name"] == NAME
    crd = yaml.safe_load((Path(__file__).parents[1] / "data" / "jobset" / "jobset.x-k8s.io_jobsets.yaml").read_text())
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2")["schema"]["openAPIV3Schema"]
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(jobset))
    assert not errors, [e.message for e in errors]
    for replicated in jobset["spec"]["replicatedJobs"]:
        (container,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        assert env["OMP_NUM_THREADS"] == "1" and env["TENSORFLEET_MODE"] == "sync"
        assert env["TENSORFLEET_TASK_TYPE"] == replicated["name"]
        assert len(container["env"]) == len(env)  # the user's TF_CONFIG did not add a second one
        assert container["command"] == ["python", "train/mnist.py", "--steps", "5"]


def test_a_jobset_job_with_a_long_name_gets_one_whose_pod_names_jobset_takes(api, jobset_backend, workspace, tmp_path):
    """JobSet's webhook counts the pod names' random end (NAME-worker-3-0-xxxxx): the name leaves room for it."""
    jobset_backend.start(make_record(workspace, name="x" * 80, workers=4), tmp_path)
    jobset = api.requests[1].body
    longest = f"{jobset['metadata']['name']}-worker-3-0-abcde"
    assert len(longest) == 63 and jobset["metadata"]["name"].startswith("tf-7-xxx")


def test_a_jobset_job_is_observed_through_the_jobset_and_its_jobs(api, jobset_backend, workspace):
    record = make_record(workspace)
    assert jobset_backend.observe(record).state is JobState.LOST  # no JobSet
    api.jobsets[NAME] = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": NAME},
                         "status": {}}
    assert jobset_backend.observe(record).state is JobState.RUNNING  # its controller has not made the Jobs yet
    api.jobs = [jobset_child(t) for t in TASKS]
    api.pods = [dict(jobset_child("worker:1"), metadata={**jobset_child("worker:1")["metadata"], "name": "w1",
                                                          "creationTimestamp": "2026-01-01T00:00:00Z"},
                     status={"containerStatuses": [{"name": "tensorfleet", "restartCount": 2, "image": "i",
                                                    "imageID": "", "ready": True}]})]
    running = jobset_backend.observe(record)
    assert running.state is JobState.RUNNING and running.restarts == 2
    api.jobsets[NAME]["status"] = {"conditions": [{"type": "Failed", "status": "True",
                                                   "message": "jobset failed due to one or more job failures"}]}
    failed = jobset_backend.observe(record)
    assert failed.state is JobState.FAILED and "one or more job failures" in failed.reason
    api.jobsets[NAME]["status"] = {"conditions": [{"type": "Completed", "status": "True"}]}
    assert jobset_backend.observe(record).state is JobState.SUCCEEDED


def test_a_jobset_jobs_tasks_logs_and_stop(api, jobset_backend, workspace):
    record = make_record(workspace)
    views = jobset_backend.tasks(record)
    assert [(v.name, v.role, v.env["TENSORFLEET_TASK_INDEX"]) for v in views] == [
        ("ps:0", "ps", "0"), ("worker:0", "chief", "0"), ("worker:1", "worker", "1")]
    cluster, me = from_tf_config(views[2].env["TF_CONFIG"], views[2].env)
    assert me.short == "worker:1" and cluster.task_address("worker", 1) == f"{NAME}-worker-1-0.{NAME}.{NS}.svc:2222"
    assert TOKEN_ENV not in views[0].env
    api.pods = [{**jobset_child("worker:1"), "metadata": {**jobset_child("worker:1")["metadata"], "name": "w1",
                                                          "creationTimestamp": "2026-01-01T00:00:00Z"}}]
    api.logs = {"w1": b"hello\n"}
    assert jobset_backend.log(record, "worker:1").text == "hello\n"
    assert api.of("GET", PODS_PATH)[0].query["labelSelector"] == (
        f"{JOB_SELECTOR},tensorfleet.io/replica-type=worker,jobset.sigs.k8s.io/job-index=1")
    api.requests.clear()
    jobset_backend.stop(record)
    assert [(r.path, r.query) for r in api.of("DELETE")] == [
        (f"{JOBSETS_PATH}/{NAME}", {"propagationPolicy": "Background"}), (f"{SECRETS_PATH}/{NAME}-token", {})]


def test_an_unknown_kubernetes_format_fails_the_backend(workspace):
    with pytest.raises(ConfigError, match="Kubernetes format 'tfjob' is not valid: use one of manifests, jobset"):
        KubernetesBackend(image="repo/train:1", namespace=NS, workspace=workspace, format="tfjob")
