"""`tensorfleet k8s render`: the objects validate against the Kubernetes API schema and wire the fleet right."""

import json
import os
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, from_tf_config
from tensorfleet.errors import ConfigError
from tensorfleet.launch import k8s
from tensorfleet.cli import main
from tensorfleet.launch.k8s import K8sJob, render_manifests, render_secret, render_tfjob, to_yaml
from tensorfleet.wire import auth

K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
SHAPES = [(1, 1, 0), (1, 2, 0), (2, 3, 1), (3, 5, 4)]  # (ps, workers, gpus per worker)
LABELS = {"app.kubernetes.io/name": "tensorfleet", "app.kubernetes.io/instance": "mnist"}
TOKEN_FROM_SECRET = {"valueFrom": {"secretKeyRef": {"name": "mnist-token", "key": "token"}}}
HEX_TOKEN = re.compile(r"[0-9a-f]{64}")


@pytest.fixture(autouse=True)
def _no_tensorfleet_env(monkeypatch):
    """The developer's own TENSORFLEET_* variables must not leak into these tests."""
    for option in k8s._OPTIONS:
        monkeypatch.delenv(option[1], raising=False)


def make_job(num_ps=1, num_workers=2, gpus=0, **overrides):
    fields = dict(name="mnist", num_ps=num_ps, num_workers=num_workers, image="repo/train:1",
                  script="examples/mnist_mlp.py", script_args=("--train_steps", "100"), gpus_per_worker=gpus,
                  namespace="ml")
    return K8sJob(**{**fields, **overrides})


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def container_of(pod_template):
    (container,) = pod_template["spec"]["containers"]
    return container


def env_of(container):
    """Name -> value of each variable, or -> {"valueFrom": ...}; every name once, with exactly one source."""
    env = {}
    for entry in container["env"]:
        assert entry["name"] not in env
        (source,) = set(entry) - {"name"}
        assert source in ("value", "valueFrom")
        env[entry["name"]] = entry["value"] if source == "value" else {"valueFrom": entry["valueFrom"]}
    return env


def env_names(container):
    return [e["name"] for e in container["env"]]


def secret_of(docs):
    (secret,) = of_kind(docs, "Secret")
    return secret


def token_of(docs):
    return secret_of(docs)["stringData"]["token"]


def containers_of(docs):
    """Every container template: one per Job, one per TFJob replica type, one per replicated job of a JobSet or
    of a TrainingRuntime's JobSet template."""
    templates = [d["spec"]["template"] for d in of_kind(docs, "Job")]
    for tfjob in of_kind(docs, "TFJob"):
        templates += [r["template"] for r in tfjob["spec"]["tfReplicaSpecs"].values()]
    jobset_specs = [d["spec"] for d in of_kind(docs, "JobSet")]
    jobset_specs += [d["spec"]["template"]["spec"] for d in of_kind(docs, "TrainingRuntime")]
    for spec in jobset_specs:
        templates += [r["template"]["spec"]["template"] for r in spec["replicatedJobs"]]
    return [container_of(t) for t in templates]


def paths_holding(obj, text, path=()):
    """The path of every key or string inside ``obj`` that contains ``text``."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if text in str(key):
                yield path + (key,)
            yield from paths_holding(value, text, path + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from paths_holding(value, text, path + (i,))
    elif isinstance(obj, str) and text in obj:
        yield path


def task_of(doc):
    labels = doc["metadata"]["labels"]
    return TaskSpec(labels["tensorfleet.io/replica-type"], int(labels["tensorfleet.io/replica-index"]))


def validate(doc, version):
    kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError if the object is wrong


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("restart", ["on-failure", "never"])
@pytest.mark.parametrize("num_ps,num_workers,gpus", SHAPES)
def test_every_object_validates_against_the_api_schema(num_ps, num_workers, gpus, restart, version):
    docs = render_manifests(make_job(num_ps, num_workers, gpus, restart=restart))
    assert len(of_kind(docs, "Service")) == len(of_kind(docs, "Job")) == num_ps + num_workers
    assert len(of_kind(docs, "Secret")) == 1 and len(docs) == 1 + 2 * (num_ps + num_workers)
    for doc in docs:
        validate(doc, version)


def test_the_schema_check_catches_a_wrong_object():
    """Guards the test above: strict validation really rejects a misspelled or mistyped field."""
    job = of_kind(render_manifests(make_job()), "Job")[0]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate({**job, "spec": {**job["spec"], "backoffLimt": 3}}, "1.30")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate({**job, "spec": {**job["spec"], "completions": "one"}}, "1.30")


def test_names_namespace_and_labels_on_every_object():
    docs = render_manifests(make_job(num_ps=2, num_workers=3))
    expected = {"mnist-ps-0", "mnist-ps-1", "mnist-worker-0", "mnist-worker-1", "mnist-worker-2"}
    for kind in ("Service", "Job"):
        assert {d["metadata"]["name"] for d in of_kind(docs, kind)} == expected
    # The token and the names exist before the pods need them.
    assert [d["kind"] for d in docs] == ["Secret"] + ["Service"] * 5 + ["Job"] * 5
    assert docs[0]["metadata"] == {"name": "mnist-token", "namespace": "ml", "labels": LABELS}
    for doc in docs:
        assert doc["metadata"]["namespace"] == "ml"
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "tensorfleet"
        assert labels["app.kubernetes.io/instance"] == "mnist"
    for doc in docs[1:]:
        labels = doc["metadata"]["labels"]
        assert doc["metadata"]["name"] == f"mnist-{labels['tensorfleet.io/replica-type']}-" \
                                          f"{labels['tensorfleet.io/replica-index']}"


@pytest.mark.parametrize("num_ps,num_workers,gpus", SHAPES)
def test_tf_config_of_each_pod_parses_back_to_the_cluster_and_its_task(num_ps, num_workers, gpus):
    job = make_job(num_ps, num_workers, gpus, port=3333)
    expected = ClusterSpec.from_dict({
        "ps": [f"mnist-ps-{i}.ml.svc:3333" for i in range(num_ps)],
        "worker": [f"mnist-worker-{i}.ml.svc:3333" for i in range(num_workers)]})
    seen = []
    for doc in of_kind(render_manifests(job), "Job"):
        container = container_of(doc["spec"]["template"])
        cluster, task = from_tf_config(env_of(container)["TF_CONFIG"])
        assert cluster == expected
        assert task == task_of(doc) == task_of(doc["spec"]["template"])
        assert doc["metadata"]["name"] == f"mnist-{task.job_name}-{task.index}"
        assert container["ports"] == [{"name": "grpc", "containerPort": 3333, "protocol": "TCP"}]
        seen.append(task)
    assert sorted(seen, key=lambda t: (t.job_name, t.index)) == sorted(
        job.tasks, key=lambda t: (t.job_name, t.index))
    assert len(set(seen)) == num_ps + num_workers


def test_tf_config_hosts_are_the_services_dns_names_and_ports():
    docs = render_manifests(make_job(num_ps=2, num_workers=2))
    services = {d["metadata"]["name"]: d for d in of_kind(docs, "Service")}
    tf_config = json.loads(env_of(container_of(of_kind(docs, "Job")[0]["spec"]["template"]))["TF_CONFIG"])
    for addresses in tf_config["cluster"].values():
        for address in addresses:
            host, port = address.rsplit(":", 1)
            service_name, namespace, svc = host.split(".")
            assert (namespace, svc) == ("ml", "svc")
            assert services[service_name]["spec"]["ports"][0]["port"] == int(port)


@pytest.mark.parametrize("num_ps,num_workers,gpus", SHAPES)
def test_each_service_selects_exactly_one_pod_template(num_ps, num_workers, gpus):
    docs = render_manifests(make_job(num_ps, num_workers, gpus))
    jobs = of_kind(docs, "Job")
    for service in of_kind(docs, "Service"):
        spec = service["spec"]
        assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
        selector = spec["selector"].items()
        matching = [j for j in jobs if selector <= j["spec"]["template"]["metadata"]["labels"].items()]
        assert [j["metadata"]["name"] for j in matching] == [service["metadata"]["name"]]
        port_names = {p["name"] for p in container_of(matching[0]["spec"]["template"])["ports"]}
        assert spec["ports"][0]["targetPort"] in port_names


def test_pods_run_the_script_with_its_args_unbuffered():
    for doc in of_kind(render_manifests(make_job()), "Job"):
        container = container_of(doc["spec"]["template"])
        assert container["image"] == "repo/train:1"
        assert container["command"] == ["python", "examples/mnist_mlp.py", "--train_steps", "100"]
        assert env_of(container)["PYTHONUNBUFFERED"] == "1"
        assert env_names(container) == ["TF_CONFIG", "PYTHONUNBUFFERED", "TENSORFLEET_TOKEN"]
        assert container["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
        assert doc["spec"]["completions"] == doc["spec"]["parallelism"] == 1


@pytest.mark.parametrize("restart,max_restarts,policy,backoff", [
    ("on-failure", 5, "OnFailure", 5), ("on-failure", 0, "OnFailure", 0), ("never", 5, "Never", 0)])
def test_restart_policy_maps_to_pod_policy_and_backoff_limit(restart, max_restarts, policy, backoff):
    job = make_job(restart=restart, max_restarts=max_restarts)
    for doc in of_kind(render_manifests(job), "Job"):
        assert doc["spec"]["template"]["spec"]["restartPolicy"] == policy
        assert doc["spec"]["backoffLimit"] == backoff
    tfjob = render_tfjob(job)
    assert tfjob["spec"]["runPolicy"]["backoffLimit"] == backoff
    assert {r["restartPolicy"] for r in tfjob["spec"]["tfReplicaSpecs"].values()} == {policy}


def test_restart_modes_are_the_local_supervisors():
    from tensorfleet.launch.supervisor import RESTART_MODES
    assert tuple(k8s.RESTART_POLICIES) == tuple(RESTART_MODES)


@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_gpus_only_on_workers(gpus):
    for doc in of_kind(render_manifests(make_job(num_ps=2, num_workers=2, gpus=gpus, cpu="500m",
                                                 memory="8Gi")), "Job"):
        resources = container_of(doc["spec"]["template"])["resources"]
        assert resources["requests"]["cpu"] == "500m" and resources["requests"]["memory"] == "8Gi"
        if task_of(doc).job_name == "worker" and gpus:
            assert resources["limits"] == {"nvidia.com/gpu": gpus}
            assert resources["requests"]["nvidia.com/gpu"] == gpus
        else:
            assert "limits" not in resources and "nvidia.com/gpu" not in resources["requests"]


@pytest.mark.parametrize("overrides,quoted", [
    ({"name": "Mnist"}, "'Mnist'"), ({"name": "1mnist"}, "'1mnist'"), ({"name": "mnist-"}, "'mnist-'"),
    ({"name": ""}, "''"), ({"namespace": "ML"}, "'ML'"), ({"num_ps": 0}, "num_ps 0"),
    ({"num_workers": -1}, "num_workers -1"), ({"num_ps": True}, "num_ps True"),
    ({"gpus_per_worker": -1}, "gpus_per_worker -1"), ({"max_restarts": -2}, "max_restarts -2"),
    ({"port": 70000}, "port 70000"), ({"port": 0}, "port 0"), ({"restart": "always"}, "'always'"),
    ({"cpu": "lots"}, "'lots'"), ({"memory": "-1Gi"}, "'-1Gi'"), ({"image": ""}, "image ''"),
    ({"script": "my script.py"}, "'my script.py'")])
def test_invalid_job_raises_an_error_quoting_the_value(overrides, quoted):
    with pytest.raises(ConfigError) as caught:
        make_job(**overrides)
    assert quoted in str(caught.value)


def test_name_length_keeps_every_derived_name_within_63_characters():
    longest_ok = "a" * (63 - len("-worker-99"))
    job = make_job(num_workers=100, name=longest_ok)
    assert max(len(d["metadata"]["name"]) for d in render_manifests(job)) == 63
    with pytest.raises(ConfigError, match=f"at most {len(longest_ok)} characters"):
        make_job(num_workers=100, name=longest_ok + "a")
    with pytest.raises(ConfigError, match="too long"):  # many ps tasks make the longest name a ps one
        make_job(num_ps=100000, num_workers=1, name="a" * (63 - len("-ps-99999") + 1))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("num_ps,num_workers,gpus", SHAPES)
def test_tfjob_structure_and_pod_templates_validate(num_ps, num_workers, gpus, version):
    tfjob = render_tfjob(make_job(num_ps, num_workers, gpus))
    assert (tfjob["apiVersion"], tfjob["kind"]) == ("kubeflow.org/v1", "TFJob")
    assert tfjob["metadata"] == {"name": "mnist", "namespace": "ml",
                                 "labels": {"app.kubernetes.io/name": "tensorfleet",
                                            "app.kubernetes.io/instance": "mnist"}}
    spec = tfjob["spec"]
    assert spec["runPolicy"] == {"backoffLimit": 3, "cleanPodPolicy": "Running"}
    assert spec["successPolicy"] == "AllWorkers"
    replicas = spec["tfReplicaSpecs"]
    assert set(replicas) == {"PS", "Worker"}
    assert (replicas["PS"]["replicas"], replicas["Worker"]["replicas"]) == (num_ps, num_workers)
    for replica_type, replica in replicas.items():
        container = container_of(replica["template"])
        assert container["name"] == "tensorflow"
        assert container["ports"] == [{"name": "tfjob-port", "containerPort": 2222, "protocol": "TCP"}]
        assert "TF_CONFIG" not in env_of(container)  # the operator injects it
        assert env_names(container) == ["PYTHONUNBUFFERED", "TENSORFLEET_TOKEN"]
        assert env_of(container)["PYTHONUNBUFFERED"] == "1"
        gpu = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpu == (gpus if replica_type == "Worker" and gpus else None)
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"mnist-{replica_type.lower()}", "namespace": "ml"},
                        "template": replica["template"]}
        validate(pod_template, version)


def test_yaml_is_multi_document_in_key_order_with_tf_config_on_one_line():
    docs = render_manifests(make_job(num_ps=3, num_workers=8))
    text = to_yaml(docs)
    assert list(yaml.safe_load_all(text)) == docs
    assert text.startswith("apiVersion: v1\nkind: Secret\n")
    assert text.split("\n---\n")[1].startswith("apiVersion: v1\nkind: Service\n")
    assert sum(1 for line in text.splitlines() if line.strip().startswith("value: '{\"cluster\"")) == 11


RENDER = ["k8s", "render", "--ps", "1", "--workers", "2", "--image", "repo/train:1", "--name", "mnist",
          "--namespace", "ml"]


def test_cli_writes_yaml_to_stdout(capsys):
    assert main(RENDER + ["examples/mnist_mlp.py", "--", "--train_steps", "100"]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "holds the job's new token" in err  # said once, and nothing else
    docs = list(yaml.safe_load_all(out))
    assert HEX_TOKEN.fullmatch(token_of(docs))
    assert docs == render_manifests(make_job(token=token_of(docs)))  # all but the token is determined


def test_cli_writes_to_an_output_file(tmp_path, capsys):
    target = tmp_path / "fleet.yaml"
    argv = RENDER + ["--gpus-per-worker", "2", "--restart", "never", "--port", "4444", "--cpu", "2",
                     "--memory", "16Gi", "-o", str(target), "train.py", "--", "--lr", "0.1"]
    assert main(argv) == 0
    assert capsys.readouterr().out == ""
    docs = list(yaml.safe_load_all(target.read_text()))
    assert HEX_TOKEN.fullmatch(token_of(docs))
    assert docs == render_manifests(make_job(gpus=2, restart="never", port=4444, cpu="2", memory="16Gi",
                                             script="train.py", script_args=("--lr", "0.1"),
                                             token=token_of(docs)))


def test_cli_tfjob_format(capsys):
    assert main(RENDER + ["--format", "tfjob", "--max-restarts", "7", "train.py"]) == 0
    secret, tfjob = yaml.safe_load_all(capsys.readouterr().out)  # the token's Secret, then the TFJob
    assert HEX_TOKEN.fullmatch(secret["stringData"]["token"])
    job = make_job(script="train.py", script_args=(), max_restarts=7, token=secret["stringData"]["token"])
    assert secret == render_secret(job)
    assert tfjob == render_tfjob(job)


def test_the_help_and_the_docs_say_a_tfjobs_backoff_limit_counts_the_whole_job(capsys):
    """runPolicy.backoffLimit is the TFJob's, all tasks together: --max-restarts is not per task there."""
    with pytest.raises(SystemExit):
        main(["k8s", "render", "--help"])
    assert "tfjob: of the whole job" in " ".join(capsys.readouterr().out.split())
    docs = (Path(__file__).parents[2] / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    tfjob = docs[docs.index("## The TFJob option"):docs.index("## Clean up")]
    assert "backoffLimit` as above" not in tfjob and "restarts of every task" in " ".join(tfjob.split())


def test_cli_options_fall_back_to_environment(monkeypatch, capsys):
    monkeypatch.setenv("TENSORFLEET_PS", "2")
    monkeypatch.setenv("TENSORFLEET_WORKERS", "3")
    monkeypatch.setenv("TENSORFLEET_IMAGE", "repo/env:2")
    monkeypatch.setenv("TENSORFLEET_NAMESPACE", "ml")
    assert main(["k8s", "render", "--workers", "1", "train.py"]) == 0  # the flag wins over the environment
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs == render_manifests(make_job(num_ps=2, num_workers=1, name="tensorfleet", image="repo/env:2",
                                             script="train.py", script_args=(), token=token_of(docs)))
    assert secret_of(docs)["metadata"]["name"] == "tensorfleet-token"


@pytest.mark.parametrize("argv,message", [
    (["--ps", "0"], "argument --ps: 0 is out of range: it must be at least 1"),
    (["--workers", "two"], "argument --workers: 'two' is not an integer"),
    (["--restart", "always"], "argument --restart: 'always' is not valid: use one of on-failure, never"),
    (["--format", "helm"], "argument --format: 'helm' is not valid: use one of manifests, tfjob"),
    (["--port", "70000"], "argument --port: 70000 is out of range: it must be in 1..65535"),
    (["--gpus-per-worker", "-1"], "argument --gpus-per-worker: -1 is out of range: it must be at least 0"),
])
def test_bad_flag_values_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        main(RENDER + argv + ["train.py"])
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_script_or_action_exit_2(capsys):
    for argv in (RENDER, ["k8s"]):
        with pytest.raises(SystemExit) as caught:
            main(argv)
        assert caught.value.code == 2
        assert "required" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["k8s", "render", "--workers", "2", "--image", "i", "train.py"], "--ps is required (or set TENSORFLEET_PS)"),
    (["k8s", "render", "--ps", "1", "--workers", "2", "train.py"], "--image is required"),
    (RENDER + ["--name", "My_Job", "train.py"], "name 'My_Job' is not a DNS-1035 label"),
    (RENDER + ["--cpu", "lots", "train.py"], "cpu 'lots' is not a Kubernetes quantity"),
    (RENDER + ["--namespace", "Prod", "train.py"], "namespace 'Prod' is not a DNS-1123 label"),
])
def test_invalid_values_exit_2_with_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("tensorfleet k8s render: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("fmt, longest", [
    ("manifests", "-worker-3"), ("tfjob", "-worker-3"),  # Services and Jobs; the operator's pods and Services
    ("jobset", "-worker-3-0-xxxxx"),  # JobSet's pod names, with the random end its webhook counts in
    ("trainjob", "-node-0-3-xxxxx")])  # the workers are pods 0..3 of the one Job of Trainer's node
def test_a_name_too_long_for_the_formats_names_exits_2_saying_the_maximum(fmt, longest, capsys):
    """50 characters with 4 workers made JobSet pod names of 67 (NAME-worker-3-0-xxxxx) that its webhook refuses."""
    room = 63 - len(longest)
    argv = ["k8s", "render", "--ps", "2", "--workers", "4", "--image", "i", "--format", fmt]
    assert main(argv + ["--name", "a" * (room + 1), "train.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"too long for --format {fmt} with 2 ps and 4 workers: use at most {room} characters" in err
    assert main(argv + ["--name", "a" * room, "train.py"]) == 0
    assert k8s.max_name_length(fmt, 2, 4) == room
    if fmt in ("jobset", "trainjob"):  # the renderers refuse it too (the job service calls them directly)
        with pytest.raises(ConfigError, match=f"at most {room} characters"):
            k8s.RENDERERS[fmt](make_job(num_ps=2, num_workers=4, name="a" * (room + 1)))


def test_bad_environment_value_exit_2_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("TENSORFLEET_MAX_RESTARTS", "many")
    assert main(RENDER + ["train.py"]) == 2
    assert "TENSORFLEET_MAX_RESTARTS='many': 'many' is not an integer" in capsys.readouterr().err


def test_unwritable_output_exit_1(tmp_path, capsys):
    assert main(RENDER + ["-o", str(tmp_path / "no" / "such" / "dir.yaml"), "train.py"]) == 1
    assert "cannot write" in capsys.readouterr().err


# --- the job's token -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("fmt", k8s.FORMATS)
def test_the_token_secret_validates_against_the_api_schema(fmt, version):
    job = make_job()
    docs = k8s.RENDERERS[fmt](job)
    assert docs[0]["kind"] == "Secret"  # first, so it exists before any pod starts
    secret = secret_of(docs)
    assert secret == {"apiVersion": "v1", "kind": "Secret",
                      "metadata": {"name": "mnist-token", "namespace": "ml", "labels": LABELS},
                      "type": "Opaque", "stringData": {"token": job.token}}
    assert secret == render_secret(job)
    validate(secret, version)
    # Guards the check: strict validation rejects a misspelled field or a token that is not a string.
    with pytest.raises(kubernetes_validate.ValidationError):
        validate({**secret, "stringdata": secret["stringData"]}, version)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate({**secret, "stringData": {"token": 5}}, version)


def test_tfjob_format_is_the_secret_then_the_tfjob():
    job = make_job()
    docs = k8s.RENDERERS["tfjob"](job)
    assert [d["kind"] for d in docs] == ["Secret", "TFJob"]
    assert docs == [render_secret(job), render_tfjob(job)]
    assert docs[0]["metadata"]["namespace"] == docs[1]["metadata"]["namespace"] == "ml"


@pytest.mark.parametrize("fmt", k8s.FORMATS)
@pytest.mark.parametrize("num_ps,num_workers,gpus", SHAPES)
def test_every_container_takes_the_token_from_the_secret(num_ps, num_workers, gpus, fmt):
    job = make_job(num_ps, num_workers, gpus)
    docs = k8s.RENDERERS[fmt](job)
    secret = secret_of(docs)
    containers = containers_of(docs)
    assert len(containers) == (num_ps + num_workers if fmt == "manifests" else 2)
    assert auth.TOKEN_ENV == "TENSORFLEET_TOKEN"  # the variable the tasks read
    for container in containers:
        entries = [e for e in container["env"] if e["name"] == "TENSORFLEET_TOKEN"]
        assert entries == [{"name": "TENSORFLEET_TOKEN", **TOKEN_FROM_SECRET}]  # exactly once, from the Secret
        ref = entries[0]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
        # What the kubelet hands the task reads back, through tensorfleet.wire.auth, as the job's token.
        resolved = {name: secret["stringData"][ref["key"]] if isinstance(value, dict) else value
                    for name, value in env_of(container).items()}
        assert auth.job_token(resolved) == job.token
        assert "TENSORFLEET_TOKEN_FILE" not in resolved


def test_the_token_is_64_hex_characters_and_new_per_job():
    first, second = make_job(), make_job()
    for job in (first, second):
        assert HEX_TOKEN.fullmatch(job.token)
        assert token_of(render_manifests(job)) == job.token
    assert first.token != second.token
    assert token_of(render_manifests(first)) != token_of(render_manifests(second))
    chosen = "0123abcd" * 8
    assert token_of(render_manifests(make_job(token=chosen))) == chosen


@pytest.mark.parametrize("fmt", k8s.FORMATS)
def test_each_cli_render_makes_a_new_token(fmt, capsys):
    tokens = []
    for _ in range(2):
        assert main(RENDER + ["--format", fmt, "train.py"]) == 0
        out = capsys.readouterr().out
        token = token_of(list(yaml.safe_load_all(out)))
        assert HEX_TOKEN.fullmatch(token)
        assert out.count(token) == 1
        tokens.append(token)
    assert tokens[0] != tokens[1]


@pytest.mark.parametrize("fmt", k8s.FORMATS)
@pytest.mark.parametrize("num_ps,num_workers,gpus", SHAPES)
def test_the_token_appears_only_in_the_secrets_string_data(num_ps, num_workers, gpus, fmt):
    job = make_job(num_ps, num_workers, gpus)
    docs = k8s.RENDERERS[fmt](job)
    text = to_yaml(docs)
    assert text.count(job.token) == 1
    assert list(paths_holding(docs, job.token)) == [(0, "stringData", "token")]
    for container in containers_of(docs):  # the point of the Secret: not on a command line, not in the pod spec
        assert not any(job.token in part for part in container["command"] + container.get("args", []))
        assert not any(job.token in str(entry.get("value", "")) for entry in container["env"])
    assert list(yaml.safe_load_all(text)) == docs


def test_repr_does_not_show_the_token():
    job = make_job(token="feedc0de" * 8)
    for shown in (repr(job), str(job)):
        assert "name='mnist'" in shown and "namespace='ml'" in shown  # the rest of the job is there
        assert job.token not in shown and "token" not in shown
    default = make_job()
    assert default.token not in repr(default) and "token" not in repr(default)


def test_a_named_token_secret_keeps_every_secret_out_of_the_output(tmp_path, capsys):
    """Issue 18 item 7: by default the printed manifests hold the token (and say so on stderr); with
    --token-secret they reference the user's own Secret and hold none."""
    from tensorfleet import cli
    out = tmp_path / "fleet.yaml"
    assert cli.main(["k8s", "render", "--ps", "1", "--workers", "1", "--image", "img:1", "--token-secret",
                     "my-token", "-o", str(out), "train.py"]) == 0
    docs = list(yaml.safe_load_all(out.read_text()))
    assert not [d for d in docs if d["kind"] == "Secret"]
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for d in docs if d["kind"] == "Job"
            for e in d["spec"]["template"]["spec"]["containers"][0]["env"] if "valueFrom" in e}
    assert refs == {"my-token"}
    assert "holds the job's new token" not in capsys.readouterr().err
    assert cli.main(["k8s", "render", "--ps", "1", "--workers", "1", "--image", "img:1", "-o", str(out),
                     "train.py"]) == 0
    assert "holds the job's new token in the Secret 'tensorfleet-token'" in capsys.readouterr().err
    assert [d for d in yaml.safe_load_all(out.read_text()) if d["kind"] == "Secret"]


# --- issue 29 ---------------------------------------------------------------------------------------------------

def test_help_shows_no_empty_default(capsys):
    with pytest.raises(SystemExit):
        main(["k8s", "render", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    assert "default )" not in text
    assert "(env TENSORFLEET_TOKEN_SECRET)" in text and "(env TENSORFLEET_PS, required)" in text
    assert "(env TENSORFLEET_NAMESPACE, default default)" in text


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask-022", "umask-000"])
def test_an_output_holding_the_token_is_written_0600_atomically(tmp_path, umask, monkeypatch, capsys):
    """The file appears by a rename of a complete 0600 file: at no moment can another user read the token."""
    target = tmp_path / "fleet.yaml"
    renames = []
    real_replace = k8s.os.replace

    def replace(source, destination):
        renames.append((os.stat(source).st_mode & 0o777, Path(destination).exists(), Path(source).read_text()))
        real_replace(source, destination)

    monkeypatch.setattr(k8s.os, "replace", replace)
    previous = os.umask(umask)
    try:
        assert main(RENDER + ["-o", str(target), "train.py"]) == 0
    finally:
        os.umask(previous)
    written = target.read_text()
    assert renames == [(0o600, False, written)] and HEX_TOKEN.search(written)
    assert target.stat().st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["fleet.yaml"]  # no temporary file left


def test_an_existing_readable_output_becomes_0600(tmp_path, capsys):
    target = tmp_path / "fleet.yaml"
    target.write_text("old\n")
    target.chmod(0o644)
    assert main(RENDER + ["-o", str(target), "train.py"]) == 0
    assert target.stat().st_mode & 0o777 == 0o600 and "kind: Secret" in target.read_text()


def test_an_output_without_the_token_keeps_the_usual_mode(tmp_path, capsys):
    target = tmp_path / "fleet.yaml"
    previous = os.umask(0o022)
    try:
        assert main(RENDER + ["--token-secret", "my-token", "-o", str(target), "train.py"]) == 0
    finally:
        os.umask(previous)
    assert target.stat().st_mode & 0o777 == 0o644 and "kind: Secret" not in target.read_text()


@pytest.mark.parametrize("fmt", k8s.FORMATS)
def test_dense_allreduce_reaches_every_pod_as_the_scripts_default(fmt, capsys):
    """Hybrid on Kubernetes: TENSORFLEET_DENSE (the default of the scripts' --dense) in every task's container;
    without the flag the pods leave the script's own default alone."""
    assert main(["k8s", "render", "--ps", "1", "--workers", "2", "--image", "repo/img:1", "--dense", "allreduce",
                 "--format", fmt, "train.py"]) == 0
    containers = containers_of(list(yaml.safe_load_all(capsys.readouterr().out)))
    assert containers and all(env_of(c).get("TENSORFLEET_DENSE") == "allreduce" for c in containers)
    assert main(["k8s", "render", "--ps", "1", "--workers", "2", "--image", "repo/img:1", "--format", fmt,
                 "train.py"]) == 0
    containers = containers_of(list(yaml.safe_load_all(capsys.readouterr().out)))
    assert all("TENSORFLEET_DENSE" not in env_of(c) for c in containers)


def test_a_dense_home_that_does_not_exist_is_refused():
    with pytest.raises(ConfigError, match="dense 'gpu' is not valid: use one of ps, allreduce"):
        make_job(dense="gpu")
