"""A real ps server on 127.0.0.1: the wire rules hold end to end (errors as statuses, nothing changes)."""

import json
import re
import socket

import pytest
import torch

from tensorfleet.errors import DeadlineExceededError, InvalidArgumentError, NotInitializedError, WireError
from tensorfleet.protocol.specs import OptimizerSpec, SyncOptions
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.wire import frame
from tensorfleet.wire.codec import TensorEntry
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.wire.rpc import WireOptions
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


def _data_channel(servers, index=0, **options):
    channel = DataChannel(task=f"/job:ps/task:{index}", options=WireOptions(**options))
    channel.set_address("127.0.0.1", servers[index].service.data_port)
    return channel


def _head(header: dict, body_bytes: int = 0) -> bytes:
    raw = json.dumps(header).encode()
    return frame.PREFIX.pack(frame.MAGIC, 1, 0, len(raw), body_bytes) + raw


def _raw_exchange(servers, request: bytes) -> tuple[str, str]:
    """Send raw bytes to ps 0's data port; return the reply's status and message."""
    with socket.create_connection(("127.0.0.1", servers[0].service.data_port), timeout=5) as sock:
        sock.sendall(request)
        head = frame.Reader(sock).read_head(max_body_bytes=1 << 20)
    return head.kind, head.meta.get("message", "")


@pytest.mark.parametrize("request_bytes, message", [
    (b"garbage" + b"\0" * 13, "bad magic"),
    (b"\x00" * 64, "bad magic"),
    (frame.PREFIX.pack(frame.MAGIC, 7, 0, 2, 0) + b"{}", "version 7"),
    (frame.PREFIX.pack(frame.MAGIC, 1, 0x80, 2, 0) + b"{}", "unknown message flags"),
    (frame.PREFIX.pack(frame.MAGIC, 1, 0, 2, 0)[:6] + b"\x01\x00" + frame.PREFIX.pack(frame.MAGIC, 1, 0, 2, 0)[8:]
     + b"{}", "reserved prefix bytes are 0100, not zero"),
    (frame.PREFIX.pack(frame.MAGIC, 1, 0, 5, 0) + b"{nope", "not valid JSON"),
    (frame.PREFIX.pack(frame.MAGIC, 1, 0, 2, 1 << 40) + b"{}", "exceeds the limit"),
    (_head({"kind": "Push", "meta": {}, "tensors": [{"name": "w", "dtype": "float99", "shape": [2]}]}),
     "unknown dtype 'float99'"),
    (_head({"kind": "Push", "meta": {}, "tensors": [{"name": "w", "dtype": "float32", "shape": [-2]}]}),
     "invalid shape"),
    (_head({"kind": "Push", "meta": [], "tensors": []}), "'meta' \\(object\\)"),
])
def test_malformed_bytes_get_invalid_argument_and_change_nothing(cluster_two_ps, request_bytes, message):
    cluster, servers, client = cluster_two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    before = _snapshot(servers)
    status, detail = _raw_exchange(servers, request_bytes)
    assert status == "INVALID_ARGUMENT" and re.search(message, detail), detail
    after = _snapshot(servers)
    assert all(torch.equal(b[n], a[n]) for b, a in zip(before, after) for n in b)
    assert client.pull().global_step == 0  # the server still serves, the step did not move


def test_header_and_body_that_disagree_are_refused(cluster_two_ps):
    _, servers, client = cluster_two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    header = json.dumps({"kind": "Push", "meta": {}, "tensors": [{"name": "w", "dtype": "float32", "shape": [2, 3]}]})
    request = frame.PREFIX.pack(frame.MAGIC, 1, 0, len(header), 4) + header.encode() + b"\0" * 4  # 24 bytes declared
    status, detail = _raw_exchange(servers, request)
    assert status == "INVALID_ARGUMENT" and "take 24 bytes but the prefix announces 4" in detail
    assert client.pull().global_step == 0


def test_a_push_cut_off_mid_body_applies_nothing(cluster_two_ps):
    _, servers, client = cluster_two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    before = _snapshot(servers)
    with socket.create_connection(("127.0.0.1", servers[0].service.data_port), timeout=5) as sock:
        sock.sendall(frame.encode_head("Push", {"advance_step": True}, [TensorEntry("w", torch.float32, (2, 3))]))
        sock.sendall(b"\0" * 10)  # 14 bytes short, then the worker dies
    assert client.pull().global_step == 0
    after = _snapshot(servers)
    assert all(torch.equal(b[n], a[n]) for b, a in zip(before, after) for n in b)


@pytest.mark.parametrize("grads, message", [
    ({"nope": torch.ones(1)}, "unknown variable 'nope'"),
    ({"w": torch.ones(3, 2)}, "gradient for 'w'"),
    ({"w": torch.ones(2, 3, dtype=torch.float16)}, "float16"),
    ({"b": torch.ones(3)}, "unknown variable 'b'"),  # b lives on the other shard
])
def test_bad_push_is_refused_with_clear_error_and_the_connection_stays_usable(cluster_two_ps, grads, message):
    cluster, servers, client = cluster_two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    before = _snapshot(servers)
    channel = _data_channel(servers)
    with pytest.raises(InvalidArgumentError, match=message):
        channel.call("Push", {"advance_step": True}, grads)
    after = _snapshot(servers)
    assert all(torch.equal(b[n], a[n]) for b, a in zip(before, after) for n in b)
    assert servers[0].store.status().global_step == 0
    meta, values = channel.call("Pull", {})  # same connection: the refused body was skipped, the stream is in step
    assert meta["step"] == 0 and torch.equal(values["w"], VALUES["w"])
    channel.close()


def test_unknown_data_method_is_refused(cluster_two_ps):
    _, servers, client = cluster_two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    channel = _data_channel(servers)
    with pytest.raises(InvalidArgumentError, match="unknown data-plane method 'Explode'"):
        channel.call("Explode", {}, {"w": torch.ones(2, 3)})
    assert channel.call("Pull", {})[0]["step"] == 0
    channel.close()


def test_pull_before_init_is_failed_precondition(cluster_two_ps):
    _, _, client = cluster_two_ps
    with pytest.raises(NotInitializedError, match="waiting for the chief"):
        client.pull()


def test_non_chief_wait_times_out_naming_the_shards(cluster_two_ps):
    _, _, client = cluster_two_ps
    with pytest.raises(DeadlineExceededError, match=r"chief to initialize.*/job:ps/task:0, /job:ps/task:1"):
        client.wait_initialized(timeout_s=0.5, poll_s=0.05)


def test_missing_ps_times_out_with_its_address():
    from tensorfleet.cluster.ports import local_cluster
    cluster = local_cluster(1, 1)  # nothing listens there
    client = PsClient(cluster, {"w": 0})
    with pytest.raises(DeadlineExceededError, match=f"ps /job:ps/task:0 at {cluster.ps_addresses[0]}"):
        client.wait_for_shards(timeout_s=0.5)
    client.close()


def test_message_size_limit_is_enforced_both_ways(cluster_two_ps):
    cluster, servers, _ = cluster_two_ps
    client = PsClient(cluster, {"w": 0, "b": 1, "c": 0, "big": 0})
    client.wait_for_shards(10)
    client.initialize({**VALUES, "big": torch.zeros(2000)}, OptimizerSpec.sgd(lr=1.0))
    client.close()
    small = _data_channel(servers, max_message_bytes=4096)
    with pytest.raises(WireError, match="exceeds the limit of 4096"):
        small.call("Pull", {})  # the reply (8,000+ bytes) is over this client's limit
    small.close()
    # the server's side: a request announcing more than its limit is refused before a byte of body is read
    status, detail = _raw_exchange(servers, frame.encode_head("Push", {}, [TensorEntry("g", torch.uint8, (1 << 31,))]))
    assert status == "INVALID_ARGUMENT" and "exceeds the limit" in detail


def test_done_from_every_worker_finishes_the_ps(cluster_two_ps):
    _, servers, client = cluster_two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    client.done(0)
    assert not servers[0].service.finished.is_set()
    client.done(1)
    assert servers[0].join(timeout=5) and servers[1].join(timeout=5)


@pytest.mark.parametrize("meta, message", [
    ({"replica": 0, "step": 5, "values": False}, "step from the future"),
    ({"replica": 7, "step": 0, "values": False}, "replica 7 is not in 0..1"),
    ({"replica": 0, "step": 0, "origin": [0, -1, 1]}, "'origin' must be \\[worker, incarnation, seq\\]"),
    ({"replica": 0, "step": 0, "origin": "me"}, "'origin' must be"),
])
def test_bad_sync_push_is_refused_and_changes_nothing(meta, message):
    with ps_servers(num_ps=1, num_workers=2) as (cluster, servers):
        client = PsClient(cluster, {"w": 0, "b": 0, "c": 0})
        client.wait_for_shards(10)
        client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0), sync=SyncOptions(replicas_to_aggregate=2, total_num_replicas=2))
        before = _snapshot(servers)
        channel = _data_channel(servers)
        with pytest.raises(InvalidArgumentError, match=message):
            channel.call("Push", meta, {n: torch.ones_like(v) for n, v in VALUES.items()})
        assert all(torch.equal(b[n], a[n]) for b, a in zip(before, _snapshot(servers)) for n in b)
        assert servers[0].store.status().global_step == 0 and servers[0].store.status().accepted_pushes == 0
        assert channel.call("Pull", {})[0]["step"] == 0  # still serving, the connection in step
        channel.close()
        client.close()
