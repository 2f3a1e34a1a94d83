"""Exactly-once pushes: a push resent after a lost reply is not applied twice; an old incarnation is refused;
NaN/Inf gradients are rejected (or applied, when the job says so)."""

import socket
import threading
import time

import pytest
import torch

from tensorfleet.errors import StaleIncarnationError
from tensorfleet.protocol.specs import OptimizerSpec, SyncOptions
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.worker.client import PsClient

VALUES = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
GRAD = {"w": torch.ones(2, 3)}


class ReplyDropper:
    """A TCP proxy in front of a data port that forwards requests and, while armed, cuts the connection
    at the first byte of a reply: the ps has done the work, the client never hears of it."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.dropped = 0
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for source, sink, replies in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(source, sink, replies, (client, server)), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool, pair: tuple) -> None:
        try:
            while data := source.recv(1 << 16):
                if replies and self.armed.is_set():
                    self.armed.clear()
                    self.dropped += 1
                    break
                sink.sendall(data)
        except OSError:
            pass
        for sock in pair:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def shard():
    with ps_servers(num_ps=1, num_workers=2) as (cluster, servers):
        yield cluster, servers[0]


def _client_through_proxy(cluster, sync=None):
    client = PsClient(cluster, {"w": 0})
    port = client.wait_for_shards(10)[0].data_port
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0), sync=sync)
    proxy = ReplyDropper(port)
    client.data[0].set_address("127.0.0.1", proxy.port)
    return client, proxy


def test_an_async_push_whose_reply_is_lost_is_resent_and_applied_once(shard):
    cluster, server = shard
    client, proxy = _client_through_proxy(cluster)
    try:
        proxy.armed.set()
        pushed = client.push(GRAD, into={"w": torch.empty(2, 3)})
        assert proxy.dropped == 1
        assert pushed.outcomes == {0: "retried"} and not pushed.dropped
        status = server.store.status()
        assert (status.applied_updates, status.global_step, status.accepted_pushes, status.retried_pushes) == (1, 1, 1, 1)
        assert status.initial_updates + status.accepted_pushes == status.applied_updates
        assert torch.equal(pushed.pulled.values["w"], VALUES["w"] - 1)  # one update, and the reply brings it
        assert client.push(GRAD).outcomes == {0: "applied"}  # the next push is a new one
        assert server.store.status().applied_updates == 2
    finally:
        client.close()
        proxy.close()


def test_a_sync_push_whose_reply_is_lost_counts_once_toward_its_step(shard):
    cluster, server = shard
    client, proxy = _client_through_proxy(cluster, sync=SyncOptions(replicas_to_aggregate=1, total_num_replicas=2))
    try:
        proxy.armed.set()
        pushed = client.push(GRAD, sync_steps=[0], replica=0, into={"w": torch.empty(2, 3)})
        assert proxy.dropped == 1 and pushed.outcomes == {0: "retried"} and pushed.global_step == 1
        status = server.store.status()
        assert (status.applied_updates, status.global_step, status.dropped_duplicate) == (1, 1, 0)
        assert torch.equal(pushed.pulled.values["w"], VALUES["w"] - 1)
    finally:
        client.close()
        proxy.close()


def test_a_push_from_a_replaced_incarnation_is_refused_and_changes_nothing(shard):
    cluster, server = shard
    old = PsClient(cluster, {"w": 0})
    old.wait_for_shards(10)
    old.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    new = PsClient(cluster, {"w": 0})  # worker 0 restarted: a later incarnation
    new.wait_for_shards(10)
    try:
        assert new.incarnation > old.incarnation
        assert new.push(GRAD, replica=0).outcomes == {0: "applied"}
        before = server.store.read()[0]["w"].clone()
        with pytest.raises(StaleIncarnationError, match="old incarnation of .*replaced"):
            old.push(GRAD, replica=0)
        assert torch.equal(server.store.read()[0]["w"], before) and server.store.status().applied_updates == 1
        assert new.push(GRAD, replica=0).outcomes == {0: "applied"}  # the live one goes on
        assert old.push(GRAD, replica=1).outcomes == {0: "applied"}  # another worker's numbering is its own
    finally:
        old.close()
        new.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_gradients_are_rejected_counted_and_change_nothing(shard, bad):
    cluster, server = shard
    client = PsClient(cluster, {"w": 0})
    client.wait_for_shards(10)
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
    try:
        grad = torch.ones(2, 3)
        grad[1, 2] = bad
        pushed = client.push({"w": grad})
        assert pushed.outcomes == {0: "rejected"} and pushed.dropped
        status = server.store.status()
        assert (status.rejected_nonfinite, status.applied_updates, status.global_step) == (1, 0, 0)
        assert torch.equal(server.store.read()[0]["w"], VALUES["w"])
        assert client.push(GRAD).outcomes == {0: "applied"}
    finally:
        client.close()


def test_nonfinite_gradients_are_applied_when_the_job_says_so(shard):
    cluster, server = shard
    client = PsClient(cluster, {"w": 0})
    client.wait_for_shards(10)
    client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0), nonfinite="apply")
    try:
        assert client.push({"w": torch.full((2, 3), float("nan"))}).outcomes == {0: "applied"}
        assert torch.isnan(server.store.read()[0]["w"]).all()
    finally:
        client.close()


@pytest.mark.parametrize("dtype_c", [torch.float32, torch.float64], ids=["one-body", "mixed-dtypes"])
def test_a_push_of_several_gradients_is_checked_whole(shard, dtype_c):
    """NaN in the last of several gradients rejects the whole push; finite gradients whose sum overflows
    float32 (3e38 + 3e38) are applied. One dtype: the body is checked as one tensor; mixed: one by one."""
    cluster, server = shard
    values = {"a": torch.zeros(4, 5), "b": torch.zeros(7), "c": torch.zeros(3, dtype=dtype_c)}
    client = PsClient(cluster, {name: 0 for name in values})
    client.wait_for_shards(10)
    client.initialize(values, OptimizerSpec.sgd(lr=1e-38))
    try:
        bad = {"a": torch.ones(4, 5), "b": torch.ones(7), "c": torch.tensor([1.0, 2.0, float("nan")], dtype=dtype_c)}
        assert client.push(bad).outcomes == {0: "rejected"}
        assert all(torch.equal(server.store.read()[0][n], v) for n, v in values.items())
        huge = {"a": torch.full((4, 5), 3e38), "b": torch.full((7,), 3e38), "c": torch.ones(3, dtype=dtype_c)}
        assert client.push(huge).outcomes == {0: "applied"}
        after = server.store.read()[0]
        assert torch.allclose(after["a"], torch.full((4, 5), -3.0)) and torch.isfinite(after["b"]).all()
        assert server.store.status().rejected_nonfinite == 1
    finally:
        client.close()


def test_an_origin_from_the_future_or_of_no_replica_is_refused_and_cannot_lock_a_worker_out():
    """Issue 18 item 7: a push claiming [0, 2**62, 0] used to become worker 0's newest incarnation, and every
    later push of the real worker 0 was refused as stale."""
    from tensorfleet.errors import InvalidArgumentError
    from tensorfleet.protocol.messages import Origin, PushRequest
    from tensorfleet.ps.store import VariableStore

    store = VariableStore(task="ps:0", replica_names=["worker:0", "worker:1"])
    store.initialize({"w": torch.zeros(2)}, OptimizerSpec.sgd(lr=1.0))
    for origin, match in ((Origin(0, 2 ** 62, 0), "ahead of this ps's clock"),
                          (Origin(7, time.time_ns(), 1), "names worker 7; the job's replicas are 0..1")):
        with pytest.raises(InvalidArgumentError, match=match):
            store.push(PushRequest(origin, advance_step=True), {"w": torch.ones(2)})
    assert torch.equal(store.read()[0]["w"], torch.zeros(2))
    real = Origin(0, time.time_ns(), 1)
    assert store.push(PushRequest(real, advance_step=True), {"w": torch.ones(2)}).reply.outcome.value == "applied"


def test_a_stream_of_nonfinite_pushes_is_counted_whole_but_logged_sparingly(caplog):
    """Issue 18 item 7: one WARNING per refused message flooded the log under fuzzing."""
    import logging

    from tensorfleet.ps.store import VariableStore

    store = VariableStore(task="ps:0", replica_names=["worker:0"])
    store.initialize({"w": torch.zeros(2)}, OptimizerSpec.sgd(lr=1.0))
    with caplog.at_level(logging.WARNING, logger="tensorfleet.ps.store"):
        for _ in range(250):
            store.reject_nonfinite(["w"], None)
    assert store.status().rejected_nonfinite == 250
    assert len([r for r in caplog.records if "NaN/Inf" in r.getMessage()]) == 7  # 1-5, 100, 200
