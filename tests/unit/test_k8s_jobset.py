"""``k8s render --format jobset``: validated against the CRD of a pinned JobSet release (tests/data/jobset, source
named there), unknown fields refused; each pod finds its own task from the shared template."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from tensorfleet.cluster.spec import from_tf_config
from tensorfleet.errors import ClusterSpecError, ConfigError
from tensorfleet.launch.k8s import K8sJob, max_name_length, render_jobset, RENDERERS, to_yaml

CRD = Path(__file__).parents[1] / "data" / "jobset" / "jobset.x-k8s.io_jobsets.yaml"
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def strict(schema: dict) -> dict:
    """The schema with every object that lists its properties closed to others, as strict field validation is
    (an object that keeps unknown fields, or maps names to values, stays open)."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)
    close(schema)
    return schema


@pytest.fixture(scope="module")
def validator():
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2")
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


def job(**fields) -> K8sJob:
    return K8sJob(**{"name": "mnist", "num_ps": 2, "num_workers": 3, "image": "repo/train:1",
                     "script": "examples/mnist_mlp.py", "script_args": ("--train_steps", "100"), **fields})


@pytest.mark.parametrize("fields", [{}, {"gpus_per_worker": 1, "restart": "never", "namespace": "ml"},
                                    {"token_secret": "shared-token", "max_restarts": 7}])
def test_a_rendered_jobset_is_valid_for_the_pinned_crd(validator, fields):
    jobset = render_jobset(job(**fields))
    errors = sorted(validator.iter_errors(jobset), key=str)
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors]


def test_the_validator_refuses_what_the_api_server_would(validator):
    wrong = render_jobset(job())
    wrong["spec"]["sucessPolicy"] = wrong["spec"].pop("successPolicy")  # a typo
    assert any("sucessPolicy" in e.message for e in validator.iter_errors(wrong))
    wrong = render_jobset(job())
    wrong["spec"]["failurePolicy"]["restartStrategy"] = "Sometimes"
    assert any("Sometimes" in e.message for e in validator.iter_errors(wrong))
    wrong = render_jobset(job())
    wrong["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["containers"][0]["env"][0]["vaule"] = 1
    assert any("vaule" in e.message for e in validator.iter_errors(wrong))


def test_two_replicated_jobs_with_the_launchers_restart_policy_and_success_when_the_workers_are_done():
    spec = render_jobset(job(max_restarts=5))["spec"]
    assert [(r["name"], r["replicas"]) for r in spec["replicatedJobs"]] == [("ps", 2), ("worker", 3)]
    for replicated in spec["replicatedJobs"]:
        job_spec = replicated["template"]["spec"]
        assert (job_spec["completions"], job_spec["parallelism"], job_spec["backoffLimit"]) == (1, 1, 5)
        assert job_spec["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["worker"]}
    assert spec["failurePolicy"] == {"maxRestarts": 0}
    assert spec["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    never = render_jobset(job(restart="never"))["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert never["backoffLimit"] == 0 and never["template"]["spec"]["restartPolicy"] == "Never"


def test_each_pod_resolves_its_own_task_from_the_shared_template_and_its_job_index():
    replicated = render_jobset(job())["spec"]["replicatedJobs"]
    for kind, count in (("ps", 2), ("worker", 3)):
        container = next(r for r in replicated if r["name"] == kind)["template"]["spec"]["template"]["spec"][
            "containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["TENSORFLEET_TASK_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.annotations['jobset.sigs.k8s.io/job-index']"
        assert env["TENSORFLEET_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "mnist-token", "key": "token"}
        for index in range(count):  # what the downward API gives pod `index` of this replicated job
            cluster, task = from_tf_config(env["TF_CONFIG"]["value"], {"TENSORFLEET_TASK_TYPE": kind,
                                                                      "TENSORFLEET_TASK_INDEX": str(index)})
            assert task.short == f"{kind}:{index}"
            # JobSet's pod name: NAME-REPLICATEDJOB-JOBINDEX-PODINDEX in the headless Service NAME
            assert cluster.task_address(kind, index) == f"mnist-{kind}-{index}-0.mnist.default.svc:2222"
    with pytest.raises(ClusterSpecError, match="TENSORFLEET_TASK_INDEX='' must be a task index"):
        from_tf_config(json.dumps({"cluster": {"worker": ["w:1"]}}), {"TENSORFLEET_TASK_TYPE": "worker"})


def webhook_name_errors(jobset: dict) -> list[str]:
    """What JobSet's validating webhook (v0.12.0, pkg/webhooks/jobset_webhook.go) says of the names a JobSet will
    make: each replicated job's last Job name, and for an Indexed Job (JobSet defaults to it) with completions set,
    its last pod's name with a 5-character random end, must be DNS-1035 labels of at most 63 characters."""
    errors, name = [], jobset["metadata"]["name"]
    for rjob in jobset["spec"]["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        names = [f"{name}-{rjob['name']}-{rjob.get('replicas', 1) - 1}"]
        if job_spec.get("completionMode", "Indexed") == "Indexed" and "completions" in job_spec:
            names.append(f"{names[0]}-{job_spec['completions'] - 1}-abcde")
        errors += [f"{n}: {len(n)} characters" for n in names if len(n) > 63 or not DNS_1035.fullmatch(n)]
    return errors


def test_the_jobset_format_renders_the_secret_then_the_jobset_and_refuses_a_name_too_long():
    docs = list(yaml.safe_load_all(to_yaml(RENDERERS["jobset"](job()))))
    assert [d["kind"] for d in docs] == ["Secret", "JobSet"]
    assert [d["kind"] for d in RENDERERS["jobset"](job(token_secret="mine"))] == ["JobSet"]
    assert "&id" not in to_yaml(RENDERERS["jobset"](job()))  # no YAML anchors: every object written out
    # 50 characters and 4 workers: pod names of 67 (NAME-worker-3-0-abcde), which the webhook refuses
    assert webhook_name_errors({"metadata": {"name": "a" * 50}, "spec": {
        "replicatedJobs": [{"name": "worker", "replicas": 4, "template": {"spec": {"completions": 1}}}]}})
    with pytest.raises(ConfigError, match="use at most 46 characters"):
        render_jobset(job(name="a" * 50, num_workers=4))
    for workers in (1, 4, 10, 1000):  # the longest name the renderer takes is one the webhook takes
        longest = job(name="a" * max_name_length("jobset", 2, workers), num_workers=workers)
        assert not webhook_name_errors(render_jobset(longest))
