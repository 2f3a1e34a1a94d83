"""A real ps server on 127.0.0.1: the wire rules hold end to end (errors as statuses, nothing changes)."""

import grpc
import pytest
import torch

from tensorfleet.errors import DeadlineExceededError, InvalidArgumentError, NotInitializedError, WireError
from tensorfleet.ps.apply import OptimizerSpec
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.wire import codec, rpc
from tensorfleet.wire.rpc import Channel, WireOptions
from tensorfleet.worker.client import PsClient

VALUES = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3), "c": torch.ones(4)}


@pytest.fixture
def cluster_two_ps():
    with ps_servers(num_ps=2, num_workers=2) as (cluster, servers):
        placement = {"w": 0, "b": 1, "c": 0}
        client = PsClient(cluster, placement)
        client.wait_for_shards(10)
        yield cluster, servers, client
        client.close()


def test_init_pull_push_across_two_shards(cluster_two_ps):
    _, servers, client = cluster_two_ps
    assert client.initialize(VALUES, OptimizerSpec.sgd(lr=0.5))
    pulled = client.pull()
    assert pulled.global_step == 0 and all(torch.equal(pulled.values[n], VALUES[n]) for n in VALUES)
    grads = {n: torch.ones_like(v) for n, v in VALUES.items()}
    assert client.push(grads).global_step == 1
    assert client.push(grads).global_step == 2
    pulled = client.pull()
    values = pulled.values
    assert pulled.global_step == 2
    for name in VALUES:
        assert torch.equal(values[name], VALUES[name] - 1.0)
    assert servers[0].store.status().applied_updates == 2
    assert servers[1].store.status().global_step == 0  # only ps 0 keeps the step


def test_second_init_keeps_trained_values(cluster_two_ps):
    _, _, client = cluster_two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    client.push({n: torch.ones_like(v) for n, v in VALUES.items()})
    assert not client.initialize({n: v + 100 for n, v in VALUES.items()}, OptimizerSpec.sgd(lr=1.0))
    assert torch.equal(client.pull().values["w"], VALUES["w"] - 1)


def _snapshot(servers):
    return [server.store.read()[0] for server in servers]


@pytest.mark.parametrize("request_bytes, message", [
    (b"garbage", "too short|bad magic"),
    (b"\x00" * 64, "bad magic"),
    (codec.encode({}, {"w": torch.ones(2, 3)})[:-5], "outside"),
])
def test_malformed_bytes_get_invalid_argument_and_change_nothing(cluster_two_ps, request_bytes, message):
    cluster, servers, client = cluster_two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    before = _snapshot(servers)
    channel = grpc.insecure_channel(cluster.ps_addresses[0])
    push = channel.unary_unary(f"/{rpc.SERVICE}/Push")
    with pytest.raises(grpc.RpcError) as caught:
        push(request_bytes, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() and __import__("re").search(message, caught.value.details())
    channel.close()
    after = _snapshot(servers)
    assert all(torch.equal(b[n], a[n]) for b, a in zip(before, after) for n in b)
    assert client.pull().global_step == 0  # the server still serves, the step did not move


@pytest.mark.parametrize("grads, message", [
    ({"nope": torch.ones(1)}, "unknown variable 'nope'"),
    ({"w": torch.ones(3, 2)}, "gradient for 'w'"),
    ({"w": torch.ones(2, 3, dtype=torch.float16)}, "float16"),
])
def test_bad_push_is_refused_with_clear_error(cluster_two_ps, grads, message):
    cluster, servers, client = cluster_two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    before = _snapshot(servers)
    channel = Channel(cluster.ps_addresses[0], task="/job:ps/task:0")
    with pytest.raises(InvalidArgumentError, match=message):
        channel.call("Push", {"advance_step": True}, grads)
    channel.close()
    after = _snapshot(servers)
    assert all(torch.equal(b[n], a[n]) for b, a in zip(before, after) for n in b)
    assert servers[0].store.status().global_step == 0


def test_pull_before_init_is_failed_precondition(cluster_two_ps):
    _, _, client = cluster_two_ps
    with pytest.raises(NotInitializedError, match="waiting for the chief"):
        client.pull()


def test_non_chief_wait_times_out_naming_the_shards(cluster_two_ps):
    _, _, client = cluster_two_ps
    with pytest.raises(DeadlineExceededError, match=r"chief to initialize.*/job:ps/task:0, /job:ps/task:1"):
        client.wait_initialized(timeout_s=0.5, poll_s=0.05)


def test_missing_ps_times_out_with_its_address():
    from tensorfleet.launch.local import local_cluster
    cluster = local_cluster(1, 1)  # nothing listens there
    client = PsClient(cluster, {"w": 0})
    with pytest.raises(DeadlineExceededError, match=f"ps /job:ps/task:0 at {cluster.ps_addresses[0]}"):
        client.wait_for_shards(timeout_s=0.5)
    client.close()


def test_message_size_limit_is_enforced_both_ways(cluster_two_ps):
    cluster, _, client = cluster_two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    small = Channel(cluster.ps_addresses[0], task="/job:ps/task:0", options=WireOptions(max_message_bytes=4096))
    with pytest.raises(WireError, match="exceeds the limit"):
        small.call("Push", {}, {"w": torch.ones(2000)})
    small.close()


def test_done_from_every_worker_finishes_the_ps(cluster_two_ps):
    _, servers, client = cluster_two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    client.done(0)
    assert not servers[0].service.finished.is_set()
    client.done(1)
    assert servers[0].join(timeout=5) and servers[1].join(timeout=5)
