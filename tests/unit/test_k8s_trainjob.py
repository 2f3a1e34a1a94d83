"""``k8s render --format trainjob``: a Kubeflow Trainer v2 TrainingRuntime and TrainJob, validated against the CRDs of
a pinned Trainer release (tests/data/trainer, source named there) with unknown fields refused; Trainer's webhook
rules, which no schema holds, checked here as its code states them; and the JobSet Trainer builds from the two
checked against JobSet's CRD and webhook, each pod finding its own task."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from test_k8s_jobset import strict, webhook_name_errors
from tensorfleet.cli import main
from tensorfleet.cluster.spec import from_tf_config
from tensorfleet.errors import ConfigError
from tensorfleet.launch.k8s import K8sJob, RENDERERS, max_name_length, render_trainjob, to_yaml

DATA = Path(__file__).parents[1] / "data"
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"


def schema_of(path: Path, version: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(path.read_text())
    found = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return jsonschema.Draft7Validator(strict(found["schema"]["openAPIV3Schema"]))


@pytest.fixture(scope="module")
def validators() -> dict[str, jsonschema.Draft7Validator]:
    return {"TrainJob": schema_of(DATA / "trainer" / "trainer.kubeflow.org_trainjobs.yaml", "v1alpha1"),
            "TrainingRuntime": schema_of(DATA / "trainer" / "trainer.kubeflow.org_trainingruntimes.yaml", "v1alpha1"),
            "JobSet": schema_of(DATA / "jobset" / "jobset.x-k8s.io_jobsets.yaml", "v1alpha2")}


def job(**fields) -> K8sJob:
    return K8sJob(**{"name": "mnist", "num_ps": 2, "num_workers": 3, "image": "repo/train:1",
                     "script": "examples/mnist_mlp.py", "script_args": ("--train_steps", "100"), **fields})


def errors_of(validator: jsonschema.Draft7Validator, obj: dict) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in sorted(validator.iter_errors(obj), key=str)]


def runtime_webhook_errors(runtime: dict) -> list[str]:
    """What Trainer's TrainingRuntime webhook (v2.3.0, pkg/webhooks/trainingruntime_webhook.go) says: a replicated
    job labelled as an ancestor has ``replicas: 1`` and the ancestor's container (the trainer's: ``node``)."""
    containers = {"trainer": "node", "model-initializer": "model-initializer",
                  "dataset-initializer": "dataset-initializer"}
    errors = []
    for rjob in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        ancestor = rjob["template"].get("metadata", {}).get("labels", {}).get(ANCESTOR)
        if ancestor not in containers:
            continue
        if rjob.get("replicas", 1) != 1:
            errors.append(f"{rjob['name']}: replicas always must be 1")
        names = [c["name"] for c in rjob["template"]["spec"]["template"]["spec"]["containers"]]
        if containers[ancestor] not in names:
            errors.append(f"{rjob['name']}: must contain the required container for the ancestor: {ancestor}")
    return errors


def trainjob_rules_errors(trainjob: dict, runtime: dict) -> list[str]:
    """The TrainJob's CEL rules (metadata.name an RFC 1035 label of at most 63 characters), which jsonschema does
    not run, and the TrainJob webhook's first question: does the runtime it names exist (here: beside it)."""
    name, ref = trainjob["metadata"]["name"], trainjob["spec"]["runtimeRef"]
    errors = [] if DNS_1035.fullmatch(name) and len(name) <= 63 else [f"metadata.name {name!r}"]
    if (ref.get("apiGroup"), ref.get("kind"), ref["name"], trainjob["metadata"]["namespace"]) != (
            "trainer.kubeflow.org", "TrainingRuntime", runtime["metadata"]["name"], runtime["metadata"]["namespace"]):
        errors.append(f"runtimeRef {ref} names no runtime rendered beside it")
    return errors


def built_jobset(runtime: dict, trainjob: dict) -> dict:
    """The JobSet Trainer's controller (v2.3.0, plain ML policy) makes of the two: named after the TrainJob, the
    runtime's template, the trainer's replicated job at one replica of numNodes pods (parallelism and completions)
    with the TrainJob's image, command and resources on its container ``node``."""
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    trainer = trainjob["spec"]["trainer"]
    for rjob in spec["replicatedJobs"]:
        if rjob["template"]["metadata"]["labels"].get(ANCESTOR) != "trainer":
            continue
        rjob["replicas"] = 1
        rjob["template"]["spec"]["parallelism"] = rjob["template"]["spec"]["completions"] = trainer["numNodes"]
        (node,) = [c for c in rjob["template"]["spec"]["template"]["spec"]["containers"] if c["name"] == "node"]
        node.update(image=trainer["image"], command=trainer["command"])
        for kind, quantities in trainer.get("resourcesPerNode", {}).items():
            node["resources"].setdefault(kind, {}).update(quantities)
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": trainjob["metadata"]["name"], "namespace": trainjob["metadata"]["namespace"]},
            "spec": spec}


SETTINGS = [{}, {"gpus_per_worker": 1, "restart": "never", "namespace": "ml"},
            {"token_secret": "shared-token", "max_restarts": 7, "num_ps": 1, "num_workers": 1}]


@pytest.mark.parametrize("fields", SETTINGS)
def test_the_runtime_the_trainjob_and_the_jobset_trainer_builds_are_valid_for_the_pinned_crds(validators, fields):
    runtime, trainjob = render_trainjob(job(**fields))
    assert (runtime["apiVersion"], runtime["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime")
    assert (trainjob["apiVersion"], trainjob["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert not errors_of(validators["TrainingRuntime"], runtime)
    assert not errors_of(validators["TrainJob"], trainjob)
    jobset = built_jobset(runtime, trainjob)
    assert not errors_of(validators["JobSet"], jobset)


@pytest.mark.parametrize("fields", SETTINGS)
def test_trainers_webhook_rules_hold(fields):
    runtime, trainjob = render_trainjob(job(**fields))
    assert not runtime_webhook_errors(runtime)
    assert not trainjob_rules_errors(trainjob, runtime)
    (node,) = [r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"] if r["name"] == "node"]
    assert node["replicas"] == 1 and node["template"]["metadata"]["labels"][ANCESTOR] == "trainer"
    assert [c["name"] for c in node["template"]["spec"]["template"]["spec"]["containers"]] == ["node"]
    assert not webhook_name_errors(built_jobset(runtime, trainjob))  # JobSet's, on what Trainer makes


def test_the_checks_refuse_what_the_api_server_and_the_webhooks_would(validators):
    runtime, trainjob = render_trainjob(job())
    wrong = copy.deepcopy(trainjob)
    wrong["spec"]["trainer"]["numNode"] = wrong["spec"]["trainer"].pop("numNodes")  # a typo
    assert any("numNode" in e for e in errors_of(validators["TrainJob"], wrong))
    wrong = copy.deepcopy(runtime)
    wrong["spec"]["template"]["spec"]["replicatedJobs"][1]["template"]["spec"]["backofLimitPerIndex"] = 3
    assert any("backofLimitPerIndex" in e for e in errors_of(validators["TrainingRuntime"], wrong))
    wrong = copy.deepcopy(runtime)
    node = wrong["spec"]["template"]["spec"]["replicatedJobs"][1]
    node["replicas"] = 3
    node["template"]["spec"]["template"]["spec"]["containers"][0]["name"] = "tensorfleet"
    assert runtime_webhook_errors(wrong) == ["node: replicas always must be 1",
                                             "node: must contain the required container for the ancestor: trainer"]
    wrong = copy.deepcopy(trainjob)
    wrong["spec"]["runtimeRef"].pop("kind")  # Trainer's default: a ClusterTrainingRuntime
    assert trainjob_rules_errors(wrong, runtime)


def test_the_workers_are_the_node_jobs_pods_and_each_pod_finds_its_own_task():
    runtime, trainjob = render_trainjob(job(num_ps=2, num_workers=3))
    jobset = built_jobset(runtime, trainjob)
    replicated = {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}
    assert [(r["name"], r["replicas"]) for r in jobset["spec"]["replicatedJobs"]] == [("ps", 2), ("node", 1)]
    assert replicated["node"]["template"]["spec"]["completions"] == 3
    annotations = {"ps": "jobset.sigs.k8s.io/job-index", "node": "batch.kubernetes.io/job-completion-index"}
    for rjob, kind, count in (("ps", "ps", 2), ("node", "worker", 3)):
        container = replicated[rjob]["template"]["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["TENSORFLEET_TASK_TYPE"]["value"] == kind
        assert env["TENSORFLEET_TASK_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            f"metadata.annotations['{annotations[rjob]}']"
        assert env["TENSORFLEET_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "mnist-token", "key": "token"}
        for index in range(count):  # what the downward API gives this task's pod
            cluster, task = from_tf_config(env["TF_CONFIG"]["value"], {"TENSORFLEET_TASK_TYPE": kind,
                                                                      "TENSORFLEET_TASK_INDEX": str(index)})
            assert task.short == f"{kind}:{index}"
            # JobSet's pod host name, NAME-RJOB-JOBINDEX-PODINDEX, in its headless Service named after the JobSet
            job_index, pod_index = (index, 0) if rjob == "ps" else (0, index)
            assert cluster.task_address(kind, index) == \
                f"{jobset['metadata']['name']}-{rjob}-{job_index}-{pod_index}.mnist.default.svc:2222"
    assert jobset["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["node"]}
    assert jobset["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}


def test_restarts_are_counted_per_task_as_in_the_other_formats():
    for restart, limit in (("on-failure", 5), ("never", 0)):
        runtime, _ = render_trainjob(job(restart=restart, max_restarts=5))
        ps, node = runtime["spec"]["template"]["spec"]["replicatedJobs"]
        ps_spec, node_spec = ps["template"]["spec"], node["template"]["spec"]
        assert (ps_spec["completions"], ps_spec["backoffLimit"]) == (1, limit)  # a Job per ps, as in jobset
        assert ps_spec["template"]["spec"]["restartPolicy"] == ("OnFailure" if restart == "on-failure" else "Never")
        # the workers share one Job: their restarts are counted per index, which Kubernetes allows only with Never,
        # and the first worker to use them up fails the Job (then the JobSet: failurePolicy.maxRestarts 0)
        assert (node_spec["completionMode"], node_spec["backoffLimitPerIndex"], node_spec["maxFailedIndexes"]) == \
            ("Indexed", limit, 0)
        assert "backoffLimit" not in node_spec and node_spec["template"]["spec"]["restartPolicy"] == "Never"
        assert runtime["spec"]["template"]["spec"]["failurePolicy"] == {"maxRestarts": 0}


def test_the_trainjob_carries_the_workers_count_image_command_and_resources():
    runtime, trainjob = render_trainjob(job(gpus_per_worker=2, cpu="4", memory="16Gi"))
    assert trainjob["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                              "name": "mnist"}
    assert trainjob["spec"]["trainer"] == {
        "numNodes": 3, "image": "repo/train:1", "command": ["python", "examples/mnist_mlp.py", "--train_steps", "100"],
        "resourcesPerNode": {"requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 2},
                             "limits": {"nvidia.com/gpu": 2}}}
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 3}
    node = runtime["spec"]["template"]["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]
    assert node["containers"][0]["resources"] == trainjob["spec"]["trainer"]["resourcesPerNode"]
    ps = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert ps["containers"][0]["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}}  # no GPU on a ps
    with pytest.raises(ConfigError, match="at most 128 items"):
        render_trainjob(job(script_args=("--flag",) * 127))


def test_the_format_renders_the_secret_the_runtime_then_the_trainjob(capsys):
    docs = list(yaml.safe_load_all(to_yaml(RENDERERS["trainjob"](job()))))
    assert [d["kind"] for d in docs] == ["Secret", "TrainingRuntime", "TrainJob"]  # the runtime before its TrainJob
    assert [d["kind"] for d in RENDERERS["trainjob"](job(token_secret="mine"))] == ["TrainingRuntime", "TrainJob"]
    assert "&id" not in to_yaml(RENDERERS["trainjob"](job()))  # no YAML anchors: every object written out
    argv = ["k8s", "render", "--format", "trainjob", "--ps", "1", "--workers", "2", "--image", "i", "train.py"]
    assert main(argv) == 0
    assert [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)] == ["Secret", "TrainingRuntime",
                                                                                 "TrainJob"]


@pytest.mark.parametrize("num_ps, workers", [(1, 1), (2, 4), (3, 10), (100, 1000)])
def test_the_longest_name_taken_is_one_jobset_and_trainer_take(num_ps, workers):
    name = "a" * max_name_length("trainjob", num_ps, workers)
    runtime, trainjob = render_trainjob(job(name=name, num_ps=num_ps, num_workers=workers))
    assert not webhook_name_errors(built_jobset(runtime, trainjob))
    assert not trainjob_rules_errors(trainjob, runtime)
    with pytest.raises(ConfigError, match="too long for --format trainjob"):
        render_trainjob(job(name=name + "a", num_ps=num_ps, num_workers=workers))
