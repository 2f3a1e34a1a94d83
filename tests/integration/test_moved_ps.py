"""A ps that a backend started again at a new address (Ray, its node gone): a client that lost it dials it where the
job's cluster file says it is now (``cluster/registry.py``), and only then."""

from __future__ import annotations

import pytest
import torch

from tensorfleet.cluster.registry import CLUSTER_FILE_ENV, current_address, read_cluster, write_cluster
from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.errors import ClusterSpecError, DeadlineExceededError
from tensorfleet.cluster.ports import free_ports
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.worker.client import PsClient


def gone_address() -> str:
    return f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there


def test_a_client_finds_a_moved_ps_through_the_cluster_file(tmp_path, monkeypatch):
    with ps_servers(num_ps=2, num_workers=1) as (cluster, _):
        jobs = cluster.as_dict()
        known = {**jobs, "ps": [jobs["ps"][0], gone_address()]}  # ps:1 as the client's TF_CONFIG knew it
        file = tmp_path / "cluster.json"
        write_cluster(file, jobs, version=1)  # ... and where it is now
        monkeypatch.setenv(CLUSTER_FILE_ENV, str(file))
        client = PsClient(ClusterSpec.from_dict(known), {"w": 0, "b": 1})
        try:
            client.wait_for_shards(20)
            assert [c.address for c in client.channels] == jobs["ps"]
            assert client.initialize({"w": torch.ones(2), "b": torch.zeros(3)}, OptimizerSpec.sgd(lr=1.0))
            assert client.push({"w": torch.ones(2), "b": torch.ones(3)}).global_step == 1
            assert torch.equal(client.pull().values["b"], -torch.ones(3))  # the moved shard holds b and applied it
        finally:
            client.close()


def test_without_a_cluster_file_a_lost_ps_is_waited_for_at_its_address(monkeypatch):
    monkeypatch.delenv(CLUSTER_FILE_ENV, raising=False)
    lost = gone_address()
    client = PsClient(ClusterSpec.from_dict({"ps": [lost], "worker": [gone_address()]}), {"w": 0})
    try:
        with pytest.raises(DeadlineExceededError, match=f"at {lost} to start"):
            client.wait_for_shards(1.0)
        assert client.channels[0].address == lost
    finally:
        client.close()


def test_the_cluster_file_is_read_whole_and_a_bad_one_says_what_it_is(tmp_path):
    file = tmp_path / "cluster.json"
    write_cluster(file, {"ps": ["10.0.0.2:7000"], "worker": ["10.0.0.3:7001"]}, version=4)
    version, cluster = read_cluster(file)
    assert version == 4 and cluster.ps_addresses == ("10.0.0.2:7000",)
    environ = {CLUSTER_FILE_ENV: str(file)}
    assert current_address("ps", 0, environ) == "10.0.0.2:7000"
    assert current_address("ps", 1, environ) is None  # not in the file: the caller keeps what it has
    assert current_address("ps", 0, {}) is None  # no file: nothing moves on this backend
    assert not list(tmp_path.glob(".*partial"))
    file.write_text("{not json")
    with pytest.raises(ClusterSpecError, match="cannot read the job's current cluster from .*cluster.json"):
        current_address("ps", 0, environ)
    with pytest.raises(ClusterSpecError, match="cannot read"):
        read_cluster(tmp_path / "missing.json")
