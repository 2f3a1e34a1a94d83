"""Optional TLS on both planes (gRPC and the data plane): certificates from files; a plaintext client cannot
talk to a TLS task, nor a TLS client to a plaintext one.

The data-plane tests here failed before the data plane had TLS: a push's bytes crossed the wire in
clear with TLS configured, and a plaintext client was served by a TLS task.
"""

import shutil
import socket
import ssl
import subprocess
import threading
import time

import pytest
import torch

from tensorfleet.errors import ConfigError, DeadlineExceededError, UnavailableError
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.testing.certificates import make_certificates
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.testing.sockets import Relay, closed_within
from tensorfleet.wire import dataserver, shm
from tensorfleet.wire.codec import TensorEntry
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.wire.dataplane import Reply
from tensorfleet.wire.dataserver import DataServer
from tensorfleet.wire.frame import send_message
from tensorfleet.wire.rpc import Channel, TlsFiles, WireOptions
from tensorfleet.worker.client import PsClient

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> TlsFiles:
    """A CA and a certificate for 127.0.0.1 signed by it, made with the openssl command."""
    return make_certificates(tmp_path_factory.mktemp("tls"))


def test_a_ps_with_tls_serves_tls_clients_and_refuses_plaintext_ones(certificates):
    tls = WireOptions(tls=certificates, token=None)
    with ps_servers(num_ps=1, num_workers=1, options=tls) as (cluster, servers):
        client = PsClient(cluster, {"w": 0}, options=tls)
        try:
            client.wait_for_shards(10)
            assert client.initialize({"w": torch.zeros(3)}, OptimizerSpec.sgd(lr=1.0))  # Init went over TLS
            assert client.push({"w": torch.ones(3)}).global_step == 1
        finally:
            client.close()
        plaintext = Channel(cluster.ps_addresses[0], task="ps:0", options=WireOptions(tls=None, token=None))
        try:
            with pytest.raises(UnavailableError):
                plaintext.call("Status", timeout=3)
        finally:
            plaintext.close()


def test_tls_settings_come_from_the_environment_all_or_none(certificates):
    assert TlsFiles.from_env({}) is None
    env = {"TENSORFLEET_TLS_CERT": certificates.cert, "TENSORFLEET_TLS_KEY": certificates.key,
           "TENSORFLEET_TLS_CA": certificates.ca}
    assert TlsFiles.from_env(env) == certificates
    with pytest.raises(ConfigError, match="missing TENSORFLEET_TLS_CA"):
        TlsFiles.from_env({k: v for k, v in env.items() if k != "TENSORFLEET_TLS_CA"})
    with pytest.raises(ConfigError, match="cannot be read"):
        TlsFiles(cert="/nonexistent.pem", key=certificates.key, ca=certificates.ca).server_credentials()
    with pytest.raises(ConfigError, match="cannot be read"):  # the data plane's contexts: at once, at start
        DataServer("127.0.0.1", {}, task="t", options=WireOptions(
            tls=TlsFiles(cert="/nonexistent.pem", key=certificates.key, ca=certificates.ca), token=None))
    with pytest.raises(ConfigError, match="cannot be read"):
        DataChannel(task="t", options=WireOptions(tls=TlsFiles(certificates.cert, certificates.key, "/none.pem")))
    with pytest.raises(ConfigError, match="cannot be loaded"):
        TlsFiles(cert=certificates.ca, key=certificates.key, ca=certificates.ca).server_context()  # not its key


# --- the data plane -------------------------------------------------------------------------------------

TOKEN = "tls-test-token"
GRADIENT = 1234.5678  # recognizable float32 patterns: the pushed gradient, and the value pulled after SGD
START = 3.0



def _pattern(value: float) -> bytes:
    """64 bytes of a float32 tensor full of ``value``, as they travel."""
    return torch.full((16,), value, dtype=torch.float32).numpy().tobytes()


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_with_tls_a_push_and_a_pull_cannot_be_read_on_the_data_connection(certificates, tls):
    """What crosses the data connection (through a recording relay): in clear without TLS (so the relay does
    see the bytes), never the gradient pushed nor the value pulled with TLS."""
    options = WireOptions(tls=certificates if tls else None, token=TOKEN, shared_memory=False)
    with ps_servers(num_ps=1, num_workers=1, options=options) as (cluster, servers):
        relay = Relay(("127.0.0.1", servers[0].service.data_port))
        client = PsClient(cluster, {"w": 0}, options=options)
        try:
            client.wait_for_shards(10)
            client.data[0].set_address("127.0.0.1", relay.port)  # the data connection goes through the relay
            numel = 1 << 16  # 256 KiB each way
            assert client.initialize({"w": torch.full((numel,), START)}, OptimizerSpec.sgd(lr=1.0))
            assert client.push({"w": torch.full((numel,), GRADIENT)}).global_step == 1
            pulled = client.pull()
            expected = torch.full((numel,), START) - torch.full((numel,), GRADIENT)
            assert torch.equal(pulled.values["w"], expected)
            wrapped = isinstance(client.data[0]._sock, ssl.SSLSocket)  # noqa: SLF001
        finally:
            client.close()
            relay.close()
    upstream, downstream = bytes(relay.upstream), bytes(relay.downstream)
    assert len(upstream) > numel * 4 and len(downstream) > numel * 4  # the bodies did cross the relay
    seen = {"gradient pushed": _pattern(GRADIENT) in upstream,
            "value pulled": _pattern(START - GRADIENT) in downstream,
            "message heads": b"TFLD" in upstream and b'"kind":"Push"' in upstream}
    assert seen == dict.fromkeys(seen, not tls), f"readable on the data connection: {seen}"
    assert wrapped == tls


@pytest.mark.parametrize("shared_memory", [False, True], ids=["tcp", "shared-memory"])
def test_pull_and_push_through_a_ps_over_tls_give_exact_values(certificates, shared_memory):
    """Through a real ps on TLS (both planes), with the job's token: several pushes of bodies larger than a
    TLS write (1 MiB), pulls into the parameters, values exact; shared memory stays on between tasks of
    one host."""
    options = WireOptions(tls=certificates, token=TOKEN, shared_memory=shared_memory)
    with ps_servers(num_ps=2, num_workers=1, options=options) as (cluster, servers):
        client = PsClient(cluster, {"big": 0, "small": 1, "ints": 1}, options=options)
        try:
            client.wait_for_shards(10)
            generator = torch.Generator().manual_seed(7)
            params = {"big": torch.randn(700_000, generator=generator),
                      "small": torch.randn(3, 5, generator=generator), "ints": torch.zeros(4)}
            expected = {name: tensor.clone() for name, tensor in params.items()}
            assert client.initialize(params, OptimizerSpec.sgd(lr=0.5))
            for step in range(1, 4):
                grads = {name: torch.randn(tensor.shape, generator=generator) for name, tensor in params.items()}
                assert client.push(grads).global_step == step
                for name, grad in grads.items():
                    expected[name] -= 0.5 * grad
                into = {name: torch.empty_like(tensor) for name, tensor in params.items()}
                pulled = client.pull(into=into)
                assert pulled.global_step == step
                for name in params:
                    assert pulled.values[name] is into[name]
                    torch.testing.assert_close(into[name], expected[name], rtol=0, atol=1e-6)
            for channel in client.data:
                sock = channel._sock  # noqa: SLF001
                assert isinstance(sock, ssl.SSLSocket) and sock.version() in ("TLSv1.3", "TLSv1.2")
            if shared_memory and shm.SUPPORTED:
                assert client.data[0].shared  # the 2.8 MB bodies went through shared memory, not the network
        finally:
            client.close()


def _echo_server(options: WireOptions) -> DataServer:
    return DataServer("127.0.0.1", {"Echo": lambda request: Reply(request.meta, request.receive())}, task="echo",
                      options=options)


def _channel(server: DataServer, options: WireOptions) -> DataChannel:
    channel = DataChannel(task=server.task, options=options)  # the proofs name the task the server is
    channel.set_address("127.0.0.1", server.port)
    return channel


def _serving_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "data-echo" and t.is_alive()]


def _until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
def test_a_plaintext_client_of_a_tls_data_server_is_refused_and_tls_clients_are_served_after(certificates, token):
    server = _echo_server(WireOptions(tls=certificates, token=token, shared_memory=False))
    plaintext = _channel(server, WireOptions(tls=None, token=token, shared_memory=False))
    secure = _channel(server, WireOptions(tls=certificates, token=token, shared_memory=False))
    try:
        for _ in range(2):
            with pytest.raises(UnavailableError, match="serves data over TLS only"):
                plaintext.call("Echo", {"clear": True}, timeout=5)
            plaintext.close()  # without a token the refusal is a reply: the connection could be reused before it ends
        assert _until(lambda: not server._connections and not _serving_threads())  # noqa: SLF001 - nothing leaks
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as stranger:
            stranger.sendall(b"\x16\x03\x01\x00\x05hello, not a TLS handshake")  # garbage: the handshake fails
            assert closed_within(stranger, 5)  # at once (perhaps after an alert), not at the Hello deadline
        for step in range(3):
            meta, tensors = secure.call("Echo", {"step": step}, {"x": torch.arange(5.0)}, timeout=5)
            assert meta == {"step": step} and torch.equal(tensors["x"], torch.arange(5.0))
        assert server.gate.refused == 0  # refused for TLS, not counted as a wrong token
    finally:
        for channel in (plaintext, secure):
            channel.close()
        server.stop()
    assert not _serving_threads()


def test_a_tls_client_of_a_plaintext_data_server_fails_naming_tls_and_the_server_keeps_serving(certificates):
    server = _echo_server(WireOptions(tls=None, token=TOKEN, shared_memory=False))
    secure = _channel(server, WireOptions(tls=certificates, token=TOKEN, shared_memory=False))
    plaintext = _channel(server, WireOptions(tls=None, token=TOKEN, shared_memory=False))
    try:
        with pytest.raises(UnavailableError, match="TLS"):
            secure.call("Echo", {}, timeout=5)
        assert plaintext.call("Echo", {"n": 1}, timeout=5)[0] == {"n": 1}
    finally:
        secure.close()
        plaintext.close()
        server.stop()


def test_a_client_refuses_a_data_server_whose_certificate_its_ca_did_not_sign(certificates, tmp_path):
    """A task presenting a certificate of another CA (a stranger on the path) is not sent anything."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out",
                    "other.pem", "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=60)
    impostor = TlsFiles(cert=str(tmp_path / "other.pem"), key=str(tmp_path / "other.key"), ca=certificates.ca)
    server = _echo_server(WireOptions(tls=impostor, token=None, shared_memory=False))
    channel = _channel(server, WireOptions(tls=certificates, token=None, shared_memory=False))
    try:
        with pytest.raises(UnavailableError, match="certificate this client does not trust"):
            channel.call("Echo", {"secret": 1}, timeout=5)
    finally:
        channel.close()
        server.stop()


def test_a_silent_server_is_a_deadline_on_a_tls_data_channel_and_the_channel_recovers(certificates):
    """TLS sockets use Python's timeout (OpenSSL retries a read the kernel's SO_RCVTIMEO cut short): no reply
    within the call's timeout is DEADLINE_EXCEEDED, as on TCP, and the next call reconnects."""
    answer = threading.Event()

    def slow(request):
        request.receive()
        answer.wait(10)
        return Reply({"late": True})

    options = WireOptions(tls=certificates, token=TOKEN, shared_memory=False)
    server = DataServer("127.0.0.1", {"Slow": slow, "Echo": lambda r: Reply(r.meta, r.receive())}, task="slow",
                        options=options)
    channel = _channel(server, options)
    try:
        assert channel.call("Echo", {"first": 1}, timeout=5)[0] == {"first": 1}
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="no progress on the data connection for 0.3 s"):
            channel.call("Slow", {}, {"x": torch.ones(3)}, timeout=0.3)
        assert time.monotonic() - started < 5
        answer.set()
        assert channel.call("Echo", {"again": 1}, timeout=5)[0] == {"again": 1}
    finally:
        channel.close()
        server.stop()


def _client_hello(certificates: TlsFiles) -> bytes:
    """The bytes a TLS client opens with (its ClientHello), made without a socket."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = certificates.client_context().wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
def test_a_dripped_tls_handshake_is_cut_off_at_the_hello_deadline_and_holds_no_one_else(
        certificates, monkeypatch, token):
    """The handshake runs on the connection's own thread (a stranger does not hold accept) and within the
    Hello's time from accept, with or without a token."""
    monkeypatch.setattr(dataserver, "HELLO_TIMEOUT_S", 1.0)
    options = WireOptions(tls=certificates, token=token, shared_memory=False)
    server = _echo_server(options)
    channel = _channel(server, options)
    hello = _client_hello(certificates)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as stranger, \
                socket.create_connection(("127.0.0.1", server.port), timeout=5) as silent:
            stranger.settimeout(0.1)
            assert channel.call("Echo", {"while": "others wait"}, timeout=5)[0] == {"while": "others wait"}
            start, cut = time.monotonic(), False
            for byte in hello:  # a byte every 0.1 s: the whole handshake would take far longer than 1 s
                try:
                    stranger.send(bytes([byte]))
                    if stranger.recv(1) == b"":
                        cut = True
                        break
                except socket.timeout:
                    continue
                except OSError:
                    cut = True
                    break
            assert cut and time.monotonic() - start < 3.0, "a dripping handshake kept its connection"
            silent.settimeout(3.0)
            assert silent.recv(1) == b""  # a connection that never said a byte is cut off too
    finally:
        channel.close()
        server.stop()
    assert not _serving_threads()


def test_a_tls_client_that_stops_reading_cannot_hold_the_servers_reply_forever(certificates):
    """The reply's send on a TLS connection is bounded by the deadline too (not by the idle timeout)."""
    released = threading.Event()
    big = torch.zeros(16 * 1024 * 1024)  # 64 MiB: far more than the socket buffers hold

    def hold(request):
        return Reply({}, {"big": big}, release=released.set)

    server = DataServer("127.0.0.1", {"Hold": hold}, task="hold",
                        options=WireOptions(tls=certificates, token=None, deadline_s=0.5, shared_memory=False))
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock = certificates.client_context().wrap_socket(raw, server_hostname="127.0.0.1")
    try:
        send_message(sock, "Hold", {})  # and never read the reply
        assert released.wait(10), "the server still holds the reply's tensors"
        assert _until(lambda: not server._connections, 10)  # noqa: SLF001 - dropped at the send bound
    finally:
        sock.close()
        server.stop()


def test_an_idle_tls_connection_closed_by_the_server_is_replaced_on_the_next_call(certificates, monkeypatch):
    monkeypatch.setattr(dataserver, "IDLE_TIMEOUT_S", 0.5)
    options = WireOptions(tls=certificates, token=TOKEN, shared_memory=False)
    server = _echo_server(options)
    channel = _channel(server, options)
    try:
        assert channel.call("Echo", {"step": 1}, timeout=5)[0] == {"step": 1}
        first = channel._sock  # noqa: SLF001
        assert _until(lambda: not server._connections), "an idle TLS connection was never closed"  # noqa: SLF001
        assert channel.call("Echo", {"step": 2}, timeout=5)[0] == {"step": 2}  # a fresh connection, no error
        assert channel._sock is not first  # noqa: SLF001
        assert channel.call("Echo", {"step": 3}, timeout=5)[0] == {"step": 3}
    finally:
        channel.close()
        server.stop()


def test_streamed_requests_and_bodies_of_every_shape_cross_a_tls_data_channel_bit_exact(certificates):
    """Heads joined with small tensors, bodies over a TLS write (1 MiB), empty tensors, mixed dtypes, a request
    streamed tensor by tensor (gradients during backward) and an aborted one: all in step on one connection."""
    options = WireOptions(tls=certificates, token=TOKEN, shared_memory=False)
    server = _echo_server(options)
    channel = _channel(server, options)
    generator = torch.Generator().manual_seed(3)
    try:
        sent = {"big": torch.randn(3_000_001, generator=generator), "empty": torch.empty(0),
                "bytes": torch.randint(0, 255, (70_000,), dtype=torch.uint8, generator=generator),
                "half": torch.randn(5, 7, generator=generator).to(torch.bfloat16), "scalar": torch.tensor(2.5)}
        meta, got = channel.call("Echo", {"n": 1}, sent, timeout=10)
        assert meta == {"n": 1} and all(torch.equal(got[name], tensor) for name, tensor in sent.items())
        tensors = [torch.randn(400_000, generator=generator), torch.randn(3, generator=generator)]
        entries = [TensorEntry.of(f"t{i}", t) for i, t in enumerate(tensors)]
        stream = channel.stream("Echo", {"s": 1}, entries, timeout=10)
        stream.send(tensors[0])
        stream.abort()  # closes the connection mid-message: the server applies nothing
        stream = channel.stream("Echo", {"s": 2}, entries, timeout=10)
        for tensor in tensors:
            stream.send(tensor)
        meta, got = stream.finish()
        assert meta == {"s": 2} and all(torch.equal(got[f"t{i}"], t) for i, t in enumerate(tensors))
        assert isinstance(channel._sock, ssl.SSLSocket)  # noqa: SLF001
    finally:
        channel.close()
        server.stop()
