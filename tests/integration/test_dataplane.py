"""The data plane end to end on 127.0.0.1: sizes around its buffers, concurrent pushes, consistent pulls, overlap."""

import socket
import threading
import time

import pytest
import torch
from torch import nn

from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.wire.dataplane import Reply, read_tensors
from tensorfleet.wire.dataserver import DataServer
from tensorfleet.wire.frame import READ_BUFFER_BYTES, Reader, send_message
from tensorfleet.wire.rpc import SHARED_MEMORY_ENV, WireOptions
from tensorfleet.worker.client import PsClient
from tensorfleet.worker.replica import Replica

# Around the reader's buffer: smaller, exactly, one byte over (as float32/uint8), much larger; and empty.
SIZES = [0, 1, READ_BUFFER_BYTES // 4 - 1, READ_BUFFER_BYTES // 4, READ_BUFFER_BYTES // 4 + 1, 3_000_001]


@pytest.fixture(autouse=True, params=["shared-memory", "tcp"])
def transport(request, monkeypatch):
    """Every test here runs over both transports of bodies between tasks on one host."""
    monkeypatch.setenv(SHARED_MEMORY_ENV, "1" if request.param == "shared-memory" else "0")
    return request.param


@pytest.fixture
def echo_server():
    """A bare data server whose 'Echo' sends back what it received (pooled buffers, no ps)."""
    server = DataServer("127.0.0.1", {"Echo": lambda request: Reply(request.meta, request.receive())}, task="echo")
    channel = DataChannel(task="echo")
    channel.set_address("127.0.0.1", server.port)
    yield channel
    channel.close()
    server.stop()


class CountingSocket:
    """A socket's receiving end that counts the calls that did not sleep (MSG_DONTWAIT)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.polls = sock, 0

    def recv_into(self, buffer, nbytes=0, flags=0):
        self.polls += bool(flags & socket.MSG_DONTWAIT)
        return self.sock.recv_into(buffer, nbytes, flags)


@pytest.mark.parametrize("delay_s", [0.0, 0.01, 0.3], ids=["at-once", "within-budget", "after-budget"])
def test_a_polling_reader_gets_every_message_whole(delay_s):
    """Polling (busy_poll_s) reads the same bytes: messages arriving at once, while it polls, and after
    its budget (0.1 s) is spent, when it sleeps in recv() instead."""
    receiving, sending = socket.socketpair()
    counting = CountingSocket(receiving)
    reader = Reader(counting, busy_poll_s=0.1)
    try:
        for i in range(3):
            sent = {"t": torch.arange(50_000 * (i + 1), dtype=torch.float32), "s": torch.tensor([i])}
            timer = threading.Timer(delay_s, send_message, (sending, "Msg", {"i": i}, sent))
            timer.start()
            head = reader.read_head(max_body_bytes=1 << 30)
            got = read_tensors(reader, head.entries, None, lambda e: torch.empty(e.shape, dtype=e.dtype))
            timer.join()
            assert head.meta == {"i": i} and all(torch.equal(got[k], v) for k, v in sent.items())
        assert counting.polls >= 1  # the first wait sleeps; later ones on the same connection poll
    finally:
        receiving.close()
        sending.close()


@pytest.mark.parametrize("numel", SIZES)
def test_tensors_of_every_size_round_trip_bit_exact(echo_server, numel):
    generator = torch.Generator().manual_seed(numel)
    sent = {"f": torch.randn(numel, generator=generator), "b": torch.randint(0, 255, (numel,), dtype=torch.uint8),
            "h": torch.randn(numel, generator=generator).to(torch.bfloat16), "scalar": torch.tensor(3.5)}
    meta, back = echo_server.call("Echo", {"n": numel}, sent)
    assert meta == {"n": numel}
    for name, tensor in sent.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_a_reply_lands_in_the_tensors_named_by_into(echo_server):
    into = {"w": torch.zeros(5, 7)}
    _, back = echo_server.call("Echo", {}, {"w": torch.ones(5, 7), "other": torch.ones(2)}, into=into)
    assert back["w"] is into["w"] and torch.equal(into["w"], torch.ones(5, 7))
    mismatched = {"w": torch.zeros(7, 5)}  # wrong shape: a new tensor, the given one untouched
    _, back = echo_server.call("Echo", {}, {"w": torch.ones(5, 7)}, into=mismatched)
    assert back["w"] is not mismatched["w"] and torch.equal(mismatched["w"], torch.zeros(7, 5))
    on_a_device = {"w": torch.empty(5, 7, device="meta")}  # a socket cannot write a device's memory: host tensor
    _, back = echo_server.call("Echo", {}, {"w": torch.ones(5, 7)}, into=on_a_device)
    assert back["w"].is_cpu and torch.equal(back["w"], torch.ones(5, 7))


def test_many_tensors_in_one_message(echo_server):
    sent = {f"t{i}": torch.full((i % 7,), float(i)) for i in range(1500)}  # more buffers than one sendmsg takes
    _, back = echo_server.call("Echo", {}, sent)
    assert all(torch.equal(back[name], tensor) for name, tensor in sent.items())


def test_interleaved_async_pushes_from_several_workers_are_each_applied_once():
    workers, pushes = 4, 60
    with ps_servers(num_ps=2, num_workers=workers) as (cluster, servers):
        placement = {"a": 0, "b": 1, "c": 0}
        shapes = {"a": (300, 100), "b": (70_000,), "c": (3,)}
        clients = [PsClient(cluster, placement) for _ in range(workers)]
        for client in clients:
            client.wait_for_shards(10)
        clients[0].initialize({n: torch.zeros(s) for n, s in shapes.items()}, OptimizerSpec.sgd(lr=1.0))

        def worker(index):
            for _ in range(pushes):  # integers: the sum is exact in any order
                clients[index].push({n: torch.full(s, -float(index + 1)) for n, s in shapes.items()}, replica=index)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        pulled = clients[0].pull()
        for client in clients:
            client.close()
    assert pulled.global_step == workers * pushes
    expected = float(pushes * sum(range(1, workers + 1)))
    for name in shapes:
        assert torch.equal(pulled.values[name], torch.full(shapes[name], expected)), name


def test_pulls_never_see_a_half_applied_update():
    """Every push adds 1 to every element; a pull taken while an update runs would mix two values."""
    with ps_servers(num_ps=1, num_workers=2) as (cluster, _):
        pusher, puller = PsClient(cluster, {"w": 0}), PsClient(cluster, {"w": 0})
        for client in (pusher, puller):
            client.wait_for_shards(10)
        pusher.initialize({"w": torch.zeros(1_000_000)}, OptimizerSpec.sgd(lr=1.0))
        stop = threading.Event()

        def push_forever():
            while not stop.is_set():
                pusher.push({"w": torch.full((1_000_000,), -1.0)})

        thread = threading.Thread(target=push_forever)
        thread.start()
        try:
            seen = set()
            for _ in range(40):
                values = puller.pull().values["w"]
                assert values.min() == values.max(), "a pull saw two different updates at once"
                seen.add(float(values[0]))
            assert len(seen) > 1  # the pushes really ran meanwhile
        finally:
            stop.set()
            thread.join(30)
            pusher.close()
            puller.close()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))


def test_overlap_with_two_backwards_refuses_the_push_and_applies_nothing():
    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        model = _model()
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1),
                     overlap=True) as replica:
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            model(torch.ones(3, 4)).sum().backward()
            model(torch.ones(3, 4)).sum().backward()  # gradient accumulation: not possible with overlap
            with pytest.raises(InvalidArgumentError, match="exactly one backward per push"):
                replica.push()
            assert servers[0].store.status().global_step == 0
            replica.pull()
            assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
            model.zero_grad(set_to_none=True)
            model(torch.ones(3, 4)).sum().backward()  # and the next step works normally
            assert replica.push() == 1


def test_overlap_backward_without_push_is_dropped_and_unused_parameters_push_zeros():
    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        model = _model()
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1),
                     overlap=True) as replica:
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
            model(torch.ones(3, 4)).sum().backward()
            model.zero_grad(set_to_none=True)
            replica.pull()  # the streamed push is abandoned mid-message: nothing applied
            assert servers[0].store.status().global_step == 0 and servers[0].store.status().applied_updates == 0
            hidden = model[1](model[0](torch.ones(3, 4)))
            model[2](hidden).sum().backward()  # the last layer gets no gradient: zeros are pushed for it
            assert replica.push() == 1
            replica.pull()
        assert torch.equal(model[3].weight.detach(), start["3.weight"])
        assert not torch.equal(model[0].weight.detach(), start["0.weight"])


def test_overlap_hooks_are_removed_when_the_replica_finishes():
    with ps_servers(num_ps=1, num_workers=1) as (cluster, _):
        model = _model()
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1), overlap=True) as r:
            model(torch.ones(3, 4)).sum().backward()
            r.push()
        model(torch.ones(3, 4)).sum().backward()  # after finish: a plain local backward, nothing streamed
        assert all(p.grad is not None for p in model.parameters())


def test_set_address_never_waits_for_a_call_in_flight():
    """A sync push can wait on a step that completes only after its caller recovered: learning a
    restarted ps's new data port must not wait for that push (it did, and recovery stalled 30 s)."""
    release = threading.Event()
    server = DataServer("127.0.0.1", {"Wait": lambda request: (release.wait(10), Reply({}))[1]}, task="slow")
    channel = DataChannel(task="slow")
    channel.set_address("127.0.0.1", server.port)
    caller = threading.Thread(target=channel.call, args=("Wait", {}))
    caller.start()
    try:
        threading.Event().wait(0.2)  # the call is in flight, holding the channel
        returned = threading.Event()
        threading.Thread(target=lambda: (channel.set_address("127.0.0.1", server.port + 1), returned.set())).start()
        assert returned.wait(2), "set_address waited for the call in flight"
        assert channel.address == ("127.0.0.1", server.port + 1)
    finally:
        release.set()
        caller.join(10)
        channel.close()
        server.stop()


@pytest.mark.parametrize("wire_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overlap", [False, True], ids=["after-backward", "overlap"])
def test_narrow_wire_dtype_keeps_fp32_on_the_ps_and_rounds_only_what_travels(wire_dtype, overlap):
    """Gradients travel narrowed and are applied in fp32; the worker gets the ps's fp32 values rounded once."""
    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        model = _model()
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1),
                     overlap=overlap, wire_dtype=wire_dtype) as replica:
            model(torch.ones(3, 4)).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            assert replica.push() == 1
            held = {**servers[0].store.read()[0], **servers[1].store.read()[0]}
            local = {n: v.clone() for n, v in start.items()}  # the same update with only the gradient rounded
            for name, tensor in local.items():
                tensor.grad = grads[name].to(wire_dtype).float()
            torch.optim.SGD(list(local.values()), lr=0.1, fused=True).step()
            for name, value in held.items():
                assert value.dtype == torch.float32  # the ps keeps fp32
                assert torch.equal(value, local[name]), name
                assert torch.equal(dict(model.named_parameters())[name].detach(), value.to(wire_dtype).float())


def test_a_push_in_the_wrong_dtype_for_the_declared_wire_dtype_is_refused():
    with ps_servers(num_ps=1, num_workers=1) as (cluster, servers):
        client = PsClient(cluster, {"w": 0})
        client.wait_for_shards(10)
        client.initialize({"w": torch.zeros(4)}, OptimizerSpec.sgd(lr=1.0))
        channel = client.data[0]
        with pytest.raises(InvalidArgumentError, match="travel as torch.bfloat16"):
            channel.call("Push", {"advance_step": True, "wire_dtype": "bfloat16"}, {"w": torch.ones(4)})
        with pytest.raises(InvalidArgumentError, match="'wire_dtype' 'int3' is not one of"):
            channel.call("Pull", {"wire_dtype": "int3"})
        assert servers[0].store.status().global_step == 0
        client.close()


def test_a_silent_server_is_a_deadline_and_the_channel_recovers():
    """No reply within the call's timeout: DEADLINE_EXCEEDED, bounded in time; the next call reconnects."""
    answer = threading.Event()

    def slow(request):
        request.receive()
        answer.wait(10)  # silent until released
        return Reply({"late": True})

    server = DataServer("127.0.0.1", {"Slow": slow, "Echo": lambda r: Reply(r.meta, r.receive())}, task="slow")
    channel = DataChannel(task="slow")
    channel.set_address("127.0.0.1", server.port)
    try:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="no progress on the data connection for 0.3 s"):
            channel.call("Slow", {}, {"x": torch.ones(3)}, timeout=0.3)
        assert time.monotonic() - started < 5
        answer.set()
        assert channel.call("Echo", {"again": 1})[0] == {"again": 1}  # a fresh connection, in step
    finally:
        channel.close()
        server.stop()


def test_a_client_that_stops_reading_cannot_hold_the_servers_reply_forever():
    """The reply's send is bounded by the deadline: the connection is dropped and the hold released."""
    released = threading.Event()
    big = torch.zeros(16 * 1024 * 1024)  # 64 MiB: far more than the socket buffers hold

    def hold(request):
        return Reply({}, {"big": big}, release=released.set)

    server = DataServer("127.0.0.1", {"Hold": hold}, task="hold", options=WireOptions(deadline_s=0.5))
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        send_message(sock, "Hold", {})  # and never read the reply
        assert released.wait(10), "the server still holds the reply's tensors"
    finally:
        sock.close()
        server.stop()


def test_stop_waits_for_the_serving_threads():
    """No serving thread outlives stop(): one still running at interpreter exit aborted the ps (SIGABRT)."""
    entered = threading.Event()

    def busy(request):
        entered.set()
        time.sleep(0.3)  # still serving when stop() is called
        return Reply({}, {"t": torch.ones(1000)})

    server = DataServer("127.0.0.1", {"Busy": busy, "Echo": lambda r: Reply(r.meta, r.receive())}, task="stopping")
    idle, busy_channel = DataChannel(task="stopping"), DataChannel(task="stopping")
    for channel in (idle, busy_channel):
        channel.set_address("127.0.0.1", server.port)
    idle.call("Echo", {})  # a connection waiting for its next request
    def call_busy():
        try:
            busy_channel.call("Busy", {})
        except UnavailableError:
            pass  # the server closed the connection before its reply: what stop() does

    caller = threading.Thread(target=call_busy)
    caller.start()
    assert entered.wait(5)
    server.stop()
    assert not [t for t in threading.enumerate() if t.name == "data-stopping" and t.is_alive()]
    caller.join(5)
    idle.close()
    busy_channel.close()


def test_a_body_of_one_dtype_is_received_as_one_tensor():
    """Tensors of one dtype arrive in one pooled buffer (``Request.body``) that they are views of, the
    same buffer request after request; mixed dtypes arrive tensor by tensor (no body)."""
    seen = []

    def keep(request):
        tensors = request.receive()
        seen.append((request.body, tensors))
        return Reply({}, {name: tensor.clone() for name, tensor in tensors.items()})

    server = DataServer("127.0.0.1", {"Keep": keep}, task="flat")
    channel = DataChannel(task="flat")
    channel.set_address("127.0.0.1", server.port)
    try:
        same = {"a": torch.randn(3, 4), "b": torch.randn(0), "c": torch.randn(5)}
        for _ in range(2):
            _, back = channel.call("Keep", {}, same)
            assert all(torch.equal(back[n], t) for n, t in same.items())
        mixed = {"a": torch.randn(3, 4), "d": torch.arange(5)}
        _, back = channel.call("Keep", {}, mixed)
        assert all(torch.equal(back[n], t) for n, t in mixed.items())
    finally:
        channel.close()
        server.stop()
    (body, tensors), (again, _), (none, _) = seen
    assert body is again and body.numel() == 17 and none is None
    assert torch.equal(body, torch.cat([same["a"].flatten(), same["c"]]))
    assert tensors["c"].untyped_storage().data_ptr() == body.untyped_storage().data_ptr()
