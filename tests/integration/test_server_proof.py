"""Every client proves its server before it sends a body or believes a reply, and a proof names the task's
incarnation (issue 41, items 1-3): a squatter at a ps address gets no checkpoint, one at a dead worker's address
gets no closure and is not believed, a recorded proof opens nothing at the task restarted, a worker's refusals show
in its Status, and a malformed reference in Run is INVALID_ARGUMENT. Everything on 127.0.0.1, on free ports."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from typing import Any, Callable

import grpc
import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.coordinator.coordinator import Coordinator
from tensorfleet.coordinator.remote import WorkerContext, name_of
from tensorfleet.coordinator.worker import ClosureServer
from tensorfleet.errors import InvalidArgumentError, UnprovenServerError
from tensorfleet.cluster.ports import free_ports, local_cluster
from tensorfleet.protocol.closures import RunReply, Trained
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.protocol.status import WorkerStatus
from tensorfleet.ps.server import Server
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.train.checkpoint import Checkpointer
from tensorfleet.wire import auth, codec, rpc
from tensorfleet.wire.rpc import SERVICE, Channel, WireOptions
from tensorfleet.worker.client import PsClient
from tensorfleet.worker.replica import Replica
from tensorfleet.worker.status import TaskStatus, serve_status

pytestmark = pytest.mark.cluster
TOKEN = auth.new_token()
OPTIONS = WireOptions(token=TOKEN, tls=None)
SPEC = OptimizerSpec.sgd(lr=0.5)
WAIT_S = 20.0


@tfl.remote
def proof_echo(value):
    return value


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def poll(condition: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.02)
    return result


class PlainSquatter:
    """A plain gRPC server on ``port`` that answers every method with ``answer`` and records what it was sent:
    a program that took a task's port (or relays nothing and forges everything)."""

    def __init__(self, port: int, answer: bytes) -> None:
        self.calls: list[tuple[str, bytes]] = []
        squatter = self

        class Everything(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
                def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
                    squatter.calls.append((details.method.rsplit("/", 1)[-1], request))
                    return answer
                return grpc.unary_unary_rpc_method_handler(unary)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers([Everything()])
        poll(lambda: self.server.add_insecure_port(f"127.0.0.1:{port}"), f"port {port} to be free")
        self.server.start()

    @property
    def methods(self) -> set[str]:
        return {method for method, _ in self.calls}

    def stop(self) -> None:
        self.server.stop(0).wait()


def raw_call(address: str, method: str, proof: str | None, request: bytes) -> tuple[grpc.StatusCode, str]:
    """One call as a stranger makes it: any metadata, any bytes."""
    channel = grpc.insecure_channel(address)
    try:
        channel.unary_unary(f"/{SERVICE}/{method}")(
            request, timeout=10, metadata=((auth.METADATA_KEY, proof),) if proof is not None else None)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    finally:
        channel.close()


# --- a squatter at a ps address when the chief starts from a checkpoint -------------------------------------------


def model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Linear(3, 2)


@pytest.fixture
def checkpointed(tmp_path, monkeypatch):
    """A checkpoint of a job with a token (one step trained), and that job's token in the environment."""
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    saver = Checkpointer(tmp_path)
    with ps_servers(num_ps=1, num_workers=1) as (cluster, _):
        trained = model()
        replica = saver.start(Replica(trained, cluster, TaskSpec("worker", 0), optimizer=SPEC))
        replica.pull()
        trained(torch.ones(4, 3)).sum().backward()
        replica.push()
        saver.save(replica)
        replica.client.close()
    return saver


def test_a_tokenless_ps_of_our_own_at_the_ps_address_is_sent_no_checkpoint(checkpointed, monkeypatch):
    cluster = local_cluster(1, 1)
    squatter = Server(cluster, job_name="ps", task_index=0, options=WireOptions(token=None, tls=None))
    chief = Replica(model(), cluster, TaskSpec("worker", 0), optimizer=SPEC, init_timeout_s=WAIT_S)
    try:
        with pytest.raises(UnprovenServerError) as raised:
            checkpointed.start(chief)
        assert not squatter.status()["initialized"]  # no Init reached it: no values, no optimizer slots
    finally:
        chief.client.close()
        squatter.stop(grace_s=0)
    said = raised.value.message
    assert f"the process at {cluster.ps_addresses[0]} answered without proving it holds the job's token" in said
    assert "'/job:ps/task:0'" in said and "nothing was sent to it" in said and "TENSORFLEET_TOKEN" in said
    assert chief.client.channels[0].servers_refused >= 1  # counted


def test_a_plain_grpc_server_at_the_ps_address_is_sent_no_checkpoint_and_not_believed(checkpointed):
    cluster = local_cluster(1, 1)
    # It says it is a ps waiting for its Init: the old chief believed it and sent every tensor.
    forged = codec.encode({"role": "ps", "initialized": False, "data_port": 1, "proof": "0" * 64,
                           "incarnation": "0" * 32})
    squatter = PlainSquatter(port_of(cluster.ps_addresses[0]), forged)
    chief = Replica(model(), cluster, TaskSpec("worker", 0), optimizer=SPEC, init_timeout_s=WAIT_S)
    try:
        with pytest.raises(UnprovenServerError, match="did not prove it is /job:ps/task:0 of this job"):
            checkpointed.start(chief)
        with pytest.raises(UnprovenServerError):  # nor is a body sent when asked directly
            chief.client.initialize({"weight": torch.zeros(2, 3)}, SPEC)
    finally:
        chief.client.close()
        squatter.stop()
    assert squatter.methods == {rpc.HELLO}  # challenged, never sent a Status, an Init or a tensor


# --- a squatter at a dead worker's address under the coordinator --------------------------------------------------


class RecordingClosureServer(ClosureServer):
    """The project's own worker server, started without the token, that forges every Run's reply."""

    def __init__(self, *args: Any) -> None:
        self.runs = 0
        super().__init__(*args)

    def _run(self, meta: dict, tensors: dict) -> rpc.Message:
        self.runs += 1
        return RunReply(result="forged", trained=Trained(1, 100_000, 0.0, 1)).to_meta(), {}


def serve_in_thread(server: ClosureServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("kind", ["own server without the token", "plain gRPC server"])
def test_a_squatter_at_a_dead_workers_address_gets_no_closure_and_is_not_believed(kind, monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    ports = free_ports(3)
    cluster = ClusterSpec.from_dict({"chief": [f"127.0.0.1:{ports[0]}"],
                                     "worker": [f"127.0.0.1:{p}" for p in ports[1:]]})
    workers = [ClosureServer(cluster, TaskSpec("worker", i), WorkerContext()) for i in range(2)]
    threads = [serve_in_thread(worker) for worker in workers]
    coordinator = Coordinator(cluster, options=OPTIONS)
    squatter: Any = None
    try:
        assert [coordinator.schedule(proof_echo, [i]).fetch(WAIT_S) for i in range(4)] == list(range(4))
        proven = coordinator._workers[1].channel
        workers[1].finished.set()  # worker 1 dies ...
        threads[1].join(timeout=WAIT_S)
        poll(lambda: proven.incarnation is None, "the coordinator to forget worker 1's proof")  # (connection lost)
        if kind == "plain gRPC server":  # ... and another program takes its port
            squatter = PlainSquatter(ports[2], codec.encode(RunReply(result="forged").to_meta()))
        else:
            with monkeypatch.context() as without:
                without.delenv(auth.TOKEN_ENV)
                squatter = poll(lambda: _bound(lambda: RecordingClosureServer(cluster, TaskSpec("worker", 1),
                                                                              WorkerContext())), "port to be free")
        results, deadline = [], time.monotonic() + WAIT_S
        while proven.servers_refused == 0:  # until worker 1's thread has tried the squatter
            assert time.monotonic() < deadline, "worker 1's thread never took a closure"
            values = [coordinator.schedule(proof_echo, [i]) for i in range(4)]
            results += [(value.fetch(WAIT_S), value.worker) for value in values]
        assert all(result != "forged" and worker == "/job:worker/task:0" for result, worker in results)
    finally:
        coordinator.shutdown(wait=False)
        workers[0].finished.set()
        threads[0].join(timeout=WAIT_S)
        if squatter is not None:
            (squatter.stop() if isinstance(squatter, PlainSquatter) else squatter.server.stop(0).wait())
    if isinstance(squatter, PlainSquatter):
        assert squatter.methods <= {rpc.HELLO}  # challenged; no Run, no Done, no argument
    else:
        assert squatter.runs == 0


def _bound(start: Callable[[], Any]) -> Any:
    """What ``start`` makes, or None while its port is still taken."""
    try:
        return start()
    except tfl.TensorfleetError:
        return None


# --- a recorded proof replayed at a restarted task ----------------------------------------------------------------


def test_a_recorded_init_replayed_at_the_restarted_ps_is_refused_and_counted(monkeypatch):
    recorded: list[tuple[str, bytes, str]] = []
    made = auth.call_proof

    def recording(token: str, method: str, task: str, request: bytes, **kwargs: Any) -> str:
        proof = made(token, method, task, request, **kwargs)
        recorded.append((method, request, proof))  # what a listener on the path sees: metadata and request
        return proof

    monkeypatch.setattr(auth, "call_proof", recording)
    with ps_servers(num_ps=1, num_workers=1, options=OPTIONS) as (cluster, servers):
        client = PsClient(cluster, {"w": 0}, options=OPTIONS)
        try:
            client.wait_for_shards(WAIT_S)
            client.initialize({"w": torch.ones(2)}, SPEC)
            _, request, proof = next(r for r in recorded if r[0].endswith("/Init"))
            address = cluster.ps_addresses[0]
            servers[0].stop(grace_s=0)  # the ps restarts on its address, empty
            servers[0] = poll(lambda: _bound(lambda: Server(cluster, job_name="ps", task_index=0, options=OPTIONS)),
                              "the ps's port to be free")
            code, detail = raw_call(address, "Init", proof, request)
            assert code == grpc.StatusCode.UNAUTHENTICATED and rpc.ANOTHER_INCARNATION in detail
            status = servers[0].status()
            assert status["auth_refused"] == 1 and not status["initialized"]
            # The job's own client proves the restarted ps again by itself, and is served.
            assert client.wait_for_shards(WAIT_S)[0].initialized is False
            assert client.channels[0].prove(timeout=WAIT_S) == servers[0].service.gate.incarnation
        finally:
            client.close()


def test_a_channel_proves_once_per_connection_and_again_after_the_task_restarted():
    with ps_servers(num_ps=1, num_workers=1, options=OPTIONS) as (cluster, servers):
        hellos = []
        for server in servers:
            gate = server.service.gate
            answer = gate.hello
            gate.hello = lambda nonce, answer=answer: hellos.append(nonce) or answer(nonce)  # type: ignore
        client = PsClient(cluster, {"w": 0}, options=OPTIONS)
        try:
            client.wait_for_shards(WAIT_S)
            client.initialize({"w": torch.ones(2)}, SPEC)
            for _ in range(5):
                client.push({"w": torch.ones(2)})
                client.global_step()
            assert len(hellos) == 1  # one connection, one Hello: nothing more per call
            # The data plane's Hello proved the same process, in the same incarnation.
            assert client.data[0].incarnation == client.channels[0].prove() == servers[0].service.gate.incarnation
            servers[0].stop(grace_s=0)
            servers[0] = poll(lambda: _bound(lambda: Server(cluster, job_name="ps", task_index=0, options=OPTIONS)),
                              "the ps's port to be free")
            assert client.wait_for_shards(WAIT_S)[0].initialized is False
            assert client.channels[0].prove(timeout=WAIT_S) == servers[0].service.gate.incarnation
        finally:
            client.close()


def test_a_client_without_a_token_does_no_handshake():
    port = free_ports(1)[0]
    squatter = PlainSquatter(port, codec.encode({"ok": True}))
    channel = Channel(f"127.0.0.1:{port}", task="/job:ps/task:0", options=WireOptions(token=None, tls=None))
    try:
        assert channel.call("Status", timeout=10)[0] == {"ok": True}
    finally:
        channel.close()
        squatter.stop()
    assert [method for method, _ in squatter.calls] == ["Status"]


def test_calls_to_several_unproven_tasks_prove_them_together():
    """The launcher's monitor asks every task at once: tasks that do not answer (stopped, say) cost their deadline
    once in all, not once each, though each must answer a Hello first."""
    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(4)]  # connections accepted, never answered
    channels = [Channel(f"127.0.0.1:{sock.getsockname()[1]}", task=f"/job:worker/task:{i}", options=OPTIONS)
                for i, sock in enumerate(silent)]
    try:
        started = time.monotonic()
        pending = [channel.call_async("Status", timeout=1.5) for channel in channels]
        for future in pending:
            with pytest.raises(tfl.TensorfleetError) as raised:
                future.result()
            assert raised.value.recoverable  # nothing there yet: not a refusal
        assert time.monotonic() - started < 4.5  # one after another: 6 s
        assert all(future.done() for future in pending)
    finally:
        for channel in channels:
            channel.close()
        for sock in silent:
            sock.close()


# --- a worker's refusals in its Status; a malformed reference in Run ----------------------------------------------


def test_a_workers_refused_calls_show_in_its_status(monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    cluster = local_cluster(1, 1)
    address, status = cluster.task_address("worker", 0), TaskStatus()
    server = serve_status(cluster, TaskSpec("worker", 0), status)
    assert server is not None
    channel = Channel(address, task="/job:worker/task:0", options=OPTIONS)
    try:
        assert raw_call(address, "Status", None, b"")[0] == grpc.StatusCode.UNAUTHENTICATED
        assert raw_call(address, "Status", "1.2.3", b"")[0] == grpc.StatusCode.UNAUTHENTICATED
        assert WorkerStatus.from_meta(channel.call("Status", timeout=10)[0]).auth_refused == 2
    finally:
        channel.close()
        server.stop(0).wait()


@pytest.mark.parametrize("reference", [{"$tensor": [1]}, {"$tensor": {"a": 1}}, {"$tensor": None},
                                       {"$per_worker": []}, {"$per_worker": {"x": 1}}, {"$per_worker": 3}])
def test_a_malformed_reference_in_run_is_invalid_argument_in_one_line(reference, monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    cluster = local_cluster(1, 1)
    worker = ClosureServer(cluster, TaskSpec("worker", 0), WorkerContext())
    channel = Channel(cluster.task_address("worker", 0), task="/job:worker/task:0", options=OPTIONS)
    try:
        with pytest.raises(InvalidArgumentError) as raised:
            channel.call("Run", {"function": name_of(proof_echo), "args": [reference]}, timeout=10)
        assert "\n" not in raised.value.message and "Traceback" not in raised.value.message
        assert "reference must name it with a string" in raised.value.message
        # ... and the coordinator's worker counts a call without the token in its Status
        assert raw_call(cluster.task_address("worker", 0), "Run", None, b"")[0] == grpc.StatusCode.UNAUTHENTICATED
        assert WorkerStatus.from_meta(channel.call("Status", timeout=10)[0]).auth_refused == 1
    finally:
        channel.close()
        worker.server.stop(0).wait()
