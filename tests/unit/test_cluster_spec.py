import argparse
import json

import pytest

from tensorfleet.cluster.flags import add_cluster_flags, cluster_from_flags
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, from_tf_config, parse_address
from tensorfleet.errors import ClusterSpecError

PS = ["127.0.0.1:2222"]
WORKERS = ["127.0.0.1:2223", "127.0.0.1:2224"]


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    return parser.parse_args(list(argv))


def test_from_dict_and_lookups():
    spec = ClusterSpec.from_dict({"ps": PS, "worker": WORKERS})
    assert spec.task_address("worker", 1) == "127.0.0.1:2224"
    assert spec.num_tasks("ps") == 1 and spec.num_tasks("chief") == 0
    assert spec.as_dict() == {"ps": PS, "worker": WORKERS}
    assert spec.replicas == (TaskSpec("worker", 0), TaskSpec("worker", 1))


def test_worker_zero_is_chief_without_chief_job():
    spec = ClusterSpec.from_dict({"ps": PS, "worker": WORKERS})
    assert spec.is_chief(TaskSpec("worker", 0))
    assert not spec.is_chief(TaskSpec("worker", 1))


def test_chief_job_makes_that_task_the_chief_and_replica_zero():
    spec = ClusterSpec.from_dict({"ps": PS, "worker": WORKERS, "chief": ["127.0.0.1:2230"]})
    assert spec.chief == TaskSpec("chief", 0)
    assert not spec.is_chief(TaskSpec("worker", 0))
    assert spec.replica_id(TaskSpec("chief", 0)) == 0
    assert spec.replica_id(TaskSpec("worker", 0)) == 1
    assert len(spec.replicas) == 3


def test_tf_config_round_trip():
    spec = ClusterSpec.from_dict({"ps": PS, "worker": WORKERS})
    text = spec.to_tf_config(TaskSpec("worker", 1))
    cluster, task = from_tf_config(text)
    assert cluster == spec and task == TaskSpec("worker", 1)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"cluster": {"ps": PS, "worker": WORKERS}}), '"task"'),
    (json.dumps({"cluster": {"ps": PS, "worker": WORKERS}, "task": {"type": "worker"}}), '"type" and "index"'),
    (json.dumps({"cluster": {"ps": PS, "worker": WORKERS}, "task": {"type": "worker", "index": "1"}}), "integer"),
    (json.dumps({"cluster": {"ps": PS, "worker": WORKERS}, "task": {"type": "master", "index": 0}}), "not in the cluster"),
])
def test_tf_config_errors(text, message):
    with pytest.raises(ClusterSpecError, match=message):
        from_tf_config(text)


def test_flags_give_cluster_and_task():
    cluster, task = cluster_from_flags(flags("--ps_hosts=" + PS[0], "--worker_hosts=" + ",".join(WORKERS),
                                             "--job_name=worker", "--task_index=1"), environ={})
    assert task == TaskSpec("worker", 1)
    assert cluster.as_dict() == {"worker": WORKERS, "ps": PS}


def test_flags_win_over_tf_config_and_tf_config_is_used_without_flags():
    env = {"TF_CONFIG": ClusterSpec.from_dict({"ps": PS, "worker": WORKERS}).to_tf_config(TaskSpec("ps", 0))}
    _, task = cluster_from_flags(flags(), environ=env)
    assert task == TaskSpec("ps", 0)


@pytest.mark.parametrize("argv, message", [
    ((), "no cluster given"),
    (("--ps_hosts=127.0.0.1:2222", "--worker_hosts=127.0.0.1:2223", "--task_index=0"), "missing flag.*--job_name"),
    (("--ps_hosts=127.0.0.1:2222", "--worker_hosts=127.0.0.1:2223", "--job_name=worker"), "--task_index"),
    (("--ps_hosts=127.0.0.1:2222", "--worker_hosts=127.0.0.1:2223", "--job_name=chef", "--task_index=0"),
     "job_name 'chef' is not in the cluster"),
    (("--ps_hosts=127.0.0.1:2222", "--worker_hosts=127.0.0.1:2223", "--job_name=worker", "--task_index=3"),
     "task_index 3 is out of range.*0..0"),
    (("--ps_hosts=127.0.0.1", "--worker_hosts=127.0.0.1:2223", "--job_name=worker", "--task_index=0"),
     "malformed address '127.0.0.1'"),
    (("--ps_hosts=127.0.0.1:2223", "--worker_hosts=127.0.0.1:2223", "--job_name=worker", "--task_index=0"),
     "duplicate address 127.0.0.1:2223"),
])
def test_flag_errors_are_clear(argv, message):
    with pytest.raises(ClusterSpecError, match=message):
        cluster_from_flags(flags(*argv), environ={})


@pytest.mark.parametrize("address", ["host", "host:", ":2222", "host:0", "host:65536", "host:port", "a b:22"])
def test_malformed_addresses(address):
    with pytest.raises(ClusterSpecError, match="malformed address"):
        parse_address(address)


def test_ipv6_address_parses():
    assert parse_address("[::1]:2222") == ("::1", 2222)


@pytest.mark.parametrize("jobs, message", [
    ({}, "at least one job"),
    ({"ps": PS}, "no worker"),
    ({"ps": "127.0.0.1:2222", "worker": WORKERS}, "must be a list"),
    ({"gpu": PS, "worker": WORKERS}, "unknown job 'gpu'"),
    ({"chief": WORKERS, "ps": PS}, "exactly one task"),
])
def test_invalid_dicts(jobs, message):
    with pytest.raises(ClusterSpecError, match=message):
        ClusterSpec.from_dict(jobs)


def test_negative_task_index_rejected():
    with pytest.raises(ClusterSpecError, match="non-negative"):
        TaskSpec("worker", -1)


def test_tasks_bind_loopback_when_named_so_and_every_interface_otherwise():
    from tensorfleet.cluster.spec import bind_address
    assert bind_address("127.0.0.1:2222") == "127.0.0.1:2222"
    assert bind_address("localhost:2222") == "localhost:2222"
    assert bind_address("[::1]:2222") == "[::1]:2222"
    assert bind_address("mnist-ps-0.ml.svc:2222") == "0.0.0.0:2222"
    assert bind_address("10.1.2.3:2222") == "0.0.0.0:2222"
