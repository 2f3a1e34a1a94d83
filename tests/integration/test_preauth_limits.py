"""What a stranger can make a data server spend before showing the job's token is bounded (issue 18, items 1-2).

Each test here failed on the code before the fix: a dripping Hello held its thread for as long
as it dripped; a head announcing 4 MiB was waited for (and allocated) before the token was
checked; connections were never capped; the accepting thread died on EMFILE and the data port
with it; an authenticated connection idle forever was never closed.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tensorfleet.errors import UnauthenticatedError
from tensorfleet.testing.sockets import closed_within
from tensorfleet.wire import dataserver, frame
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.wire.dataplane import Reply
from tensorfleet.wire.dataserver import DataServer
from tensorfleet.wire.rpc import WireOptions

TOKEN = "s3cret-token"
pytestmark = pytest.mark.cluster


def echo_server(options: WireOptions) -> DataServer:
    return DataServer("127.0.0.1", {"Echo": lambda request: Reply(request.meta, request.receive())}, task="echo",
                      options=options)


def channel_to(server: DataServer, token: str | None = TOKEN) -> DataChannel:
    channel = DataChannel(task="echo", options=WireOptions(token=token, shared_memory=False))
    channel.set_address("127.0.0.1", server.port)
    return channel


@pytest.fixture
def guarded():
    server = echo_server(WireOptions(token=TOKEN, shared_memory=False))
    yield server
    server.stop()


def test_a_hello_dripped_a_byte_at_a_time_is_cut_off_at_the_hello_deadline(monkeypatch):
    monkeypatch.setattr(dataserver, "HELLO_TIMEOUT_S", 1.0)
    server = echo_server(WireOptions(token=TOKEN, shared_memory=False))
    payload = frame.PREFIX.pack(frame.MAGIC, frame.VERSION, 0, 100, 0) + b" " * 100  # each byte in time
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            start, cut = time.monotonic(), False
            for byte in payload:
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    cut = True
                    break
                if closed_within(sock, 0.25):
                    cut = True
                    break
            assert cut, "a dripping Hello kept its connection for the whole drip"
            assert time.monotonic() - start < 3.0
    finally:
        server.stop()


def test_a_head_announcing_megabytes_is_refused_before_the_token_without_waiting_for_it(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=5) as sock:
        # A valid prefix announcing a 4 MiB header (just under the general limit), and nothing more.
        sock.sendall(frame.PREFIX.pack(frame.MAGIC, frame.VERSION, 0, frame.MAX_HEADER_BYTES - 1, 0))
        reader = frame.Reader(sock)
        head = reader.read_head(max_body_bytes=1 << 20)  # answered at once: nothing was waited for
        assert head.kind == UnauthenticatedError.code
        assert closed_within(sock, 2.0)
    assert guarded.gate.refused == 1


def test_connections_without_their_hello_are_capped_and_the_job_is_served_once_they_go(monkeypatch):
    monkeypatch.setattr(dataserver, "MAX_UNAUTHENTICATED", 4)
    monkeypatch.setattr(dataserver, "HELLO_TIMEOUT_S", 1.5)
    server = echo_server(WireOptions(token=TOKEN, shared_memory=False))
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
    try:
        time.sleep(0.2)  # accepted, counted
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        assert closed_within(extra, 1.0), "a fifth connection without its Hello was kept"
        extra.close()
        assert server.refused_connections >= 1
        assert all(closed_within(sock, 4.0) for sock in silent)  # each cut off at its Hello deadline
        channel = channel_to(server)
        try:
            meta, tensors = channel.call("Echo", {"n": 1}, {"x": torch.arange(3.0)}, timeout=5)
            assert meta == {"n": 1} and torch.equal(tensors["x"], torch.arange(3.0))
        finally:
            channel.close()
    finally:
        for sock in silent:
            sock.close()
        server.stop()


def test_an_idle_connection_is_closed_and_the_client_reconnects_on_its_next_call(monkeypatch):
    monkeypatch.setattr(dataserver, "IDLE_TIMEOUT_S", 0.5)
    server = echo_server(WireOptions(token=TOKEN, shared_memory=False))
    channel = channel_to(server)
    try:
        assert channel.call("Echo", {"step": 1}, timeout=5)[0] == {"step": 1}
        deadline = time.monotonic() + 5
        while server._connections and time.monotonic() < deadline:  # noqa: SLF001 - the server's own count
            time.sleep(0.05)
        assert not server._connections, "an idle authenticated connection was never closed"  # noqa: SLF001
        assert channel.call("Echo", {"step": 2}, timeout=5)[0] == {"step": 2}  # a fresh connection, no error
    finally:
        channel.close()
        server.stop()


SERVER_WITH_FEW_DESCRIPTORS = textwrap.dedent("""
    import resource, sys, time
    from tensorfleet.wire.dataplane import Reply
    from tensorfleet.wire.dataserver import DataServer
    from tensorfleet.wire.rpc import WireOptions
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    server = DataServer("127.0.0.1", {"Echo": lambda r: Reply(r.meta, r.receive())}, task="echo",
                        options=WireOptions(token=None, shared_memory=False))
    print(server.port, flush=True)
    time.sleep(60)
""")


def test_a_data_server_out_of_file_descriptors_keeps_accepting_once_they_are_back():
    process = subprocess.Popen([sys.executable, "-c", SERVER_WITH_FEW_DESCRIPTORS], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    flood: list[socket.socket] = []
    try:
        port = int(process.stdout.readline())
        for _ in range(80):  # more than the server's 64 descriptors: accept() fails with EMFILE
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(1.0)
        for sock in flood:
            sock.close()
        flood.clear()
        channel = DataChannel(task="echo", options=WireOptions(token=None, shared_memory=False))
        channel.set_address("127.0.0.1", port)
        try:
            deadline = time.monotonic() + 15
            while True:
                try:
                    assert channel.call("Echo", {"alive": True}, timeout=2)[0] == {"alive": True}
                    break
                except Exception:  # noqa: BLE001 - the server may still be backing off; bounded below
                    channel.close()
                    channel = DataChannel(task="echo", options=WireOptions(token=None, shared_memory=False))
                    channel.set_address("127.0.0.1", port)
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        finally:
            channel.close()
    finally:
        for sock in flood:
            sock.close()
        process.kill()
        stderr = process.communicate(timeout=10)[1]
    assert "cannot accept a data connection" in stderr, stderr[-2000:]


GRPC_SERVER = textwrap.dedent("""
    import time
    from tensorfleet.wire import rpc
    from tensorfleet.wire.rpc import WireOptions
    server, port = rpc.start_server("127.0.0.1:0", {"Status": lambda meta, tensors: ({"ok": True}, {})},
                                    task="ps:0", options=WireOptions(token="the-token"))
    print(port, flush=True)
    time.sleep(60)
""")


def test_grpc_refuses_a_call_without_the_token_before_reading_its_message():
    import grpc
    import psutil

    process = subprocess.Popen([sys.executable, "-c", GRPC_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline())
        server = psutil.Process(process.pid)
        time.sleep(0.3)
        before = server.memory_info().rss
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 1 << 30)]) as ch:
            status = ch.unary_unary("/tensorfleet.ParameterServer/Status")
            payload = b"x" * (128 << 20)
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as refused:
                    status(payload, timeout=30)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        growth = server.memory_info().rss - before
        assert growth < 48 << 20, f"the ps buffered {growth >> 20} MiB of requests it refused"  # was 2 x 128+
    finally:
        process.kill()
        process.wait(timeout=10)


def test_a_connection_that_gets_no_thread_is_closed_and_the_port_stays(monkeypatch):
    server = echo_server(WireOptions(token=None, shared_memory=False))
    real_start, failures = dataserver.threading.Thread.start, [1]

    def start(thread):  # the first serving thread cannot start (out of threads), later ones can
        if thread.name.startswith("data-echo") and failures:
            failures.pop()
            raise RuntimeError("can't start new thread")
        return real_start(thread)

    monkeypatch.setattr(dataserver.threading.Thread, "start", start)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as doomed:
            assert closed_within(doomed, 3.0)
        channel = channel_to(server, token=None)
        try:
            assert channel.call("Echo", {"after": True}, timeout=5)[0] == {"after": True}
        finally:
            channel.close()
    finally:
        monkeypatch.undo()
        server.stop()
