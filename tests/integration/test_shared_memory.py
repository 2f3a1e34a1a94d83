"""Bodies through shared memory between tasks on one host: used when it can be, refused cleanly when not,
and never trusted beyond what was attached."""

import os
import socket

import pytest
import torch

from tensorfleet.wire import frame, shm
from tensorfleet.wire.dataplane import SHARED_MIN_BYTES, DataChannel, DataServer, Reply, _same_host
from tensorfleet.wire.frame import Reader, encode_head, send_buffers
from tensorfleet.wire.rpc import WireOptions

pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm on this host")

BIG = SHARED_MIN_BYTES // 4 * 3  # float32 elements: a body well over the threshold


def _echo(request):
    return Reply(dict(request.meta, shared=request._shared), request.receive())


def _channel(server: DataServer, **options) -> DataChannel:
    channel = DataChannel(task="echo", options=WireOptions(**options))
    channel.set_address("127.0.0.1", server.port)
    return channel


@pytest.fixture
def server():
    server = DataServer("127.0.0.1", {"Echo": _echo}, task="echo", options=WireOptions(shared_memory=True))
    yield server
    server.stop()


def _our_segments() -> set[str]:
    return {name for name in os.listdir(shm.SHM_DIR) if name.startswith(f"{shm.NAME_PREFIX}{os.getpid()}-")}


def test_large_bodies_go_through_shared_memory_both_ways_and_leave_no_file(server):
    channel = _channel(server, shared_memory=True)
    try:
        sent = {"a": torch.randn(BIG), "b": torch.arange(7, dtype=torch.float32)}
        meta, first = channel.call("Echo", {}, sent)
        assert meta["shared"] and channel.shared  # the request went through the segment
        assert all(torch.equal(first[k], v) for k, v in sent.items())
        into = {k: torch.empty_like(v) for k, v in sent.items()}
        meta, second = channel.call("Echo", {"n": 2}, sent, into=into)  # the reply area now fits too
        assert meta == {"n": 2, "shared": True}
        assert channel._segment.reply_bytes >= BIG * 4
        assert all(second[k] is into[k] and torch.equal(into[k], v) for k, v in sent.items())
        assert not _our_segments()  # unlinked as soon as attached
    finally:
        channel.close()


def test_small_bodies_stay_on_the_socket(server):
    channel = _channel(server, shared_memory=True)
    try:
        meta, _ = channel.call("Echo", {}, {"t": torch.ones(10)})
        assert not meta["shared"] and not channel.shared
    finally:
        channel.close()


def test_the_segment_grows_with_the_bodies_and_mixed_dtypes_are_copied_exactly(server):
    channel = _channel(server, shared_memory=True)
    try:
        for scale in (1, 3, 2):
            sent = {"bytes": torch.randint(0, 255, (3,), dtype=torch.uint8),  # misaligns what follows
                    "f": torch.randn(BIG * scale), "d": torch.randn(5, dtype=torch.float64),
                    "empty": torch.empty(0, 4), "flags": torch.tensor([True, False, True])}
            meta, got = channel.call("Echo", {}, sent)
            assert meta["shared"]
            assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in sent.items())
        assert channel._segment.request_bytes >= BIG * 3 * 4
    finally:
        channel.close()


@pytest.mark.parametrize("side", ["server", "client"])
def test_shared_memory_off_on_either_side_keeps_tcp(side):
    server = DataServer("127.0.0.1", {"Echo": _echo}, task="echo",
                        options=WireOptions(shared_memory=side != "server"))
    channel = _channel(server, shared_memory=side != "client")
    try:
        sent = {"t": torch.randn(BIG)}
        for _ in range(2):
            meta, got = channel.call("Echo", {}, sent)
            assert not meta["shared"] and not channel.shared
            assert torch.equal(got["t"], sent["t"])
        assert not _our_segments()
    finally:
        channel.close()
        server.stop()


def test_a_stream_through_shared_memory_sends_its_head_last_and_an_abort_keeps_the_connection(server):
    channel = _channel(server, shared_memory=True)
    try:
        channel.call("Echo", {}, {"t": torch.randn(BIG)})  # attach
        tensors = [torch.randn(BIG), torch.randn(3)]
        entries = [frame.TensorEntry.of(f"t{i}", t) for i, t in enumerate(tensors)]
        stream = channel.stream("Echo", {"s": 1}, entries)
        stream.send(tensors[0])
        stream.abort()  # nothing was sent: the server saw nothing, the connection and segment stay
        assert channel.shared
        stream = channel.stream("Echo", {"s": 2}, entries)
        for tensor in tensors:
            stream.send(tensor)
        meta, got = stream.finish()
        assert meta == {"s": 2, "shared": True}
        assert torch.equal(got["t0"], tensors[0]) and torch.equal(got["t1"], tensors[1])
    finally:
        channel.close()


def test_a_head_claiming_a_shared_body_without_a_segment_is_refused_and_the_server_keeps_serving(server):
    """A peer that skips the Attach (or lies about sizes) gets a clear error; nothing is read from memory."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        entries = [frame.TensorEntry.of("t", torch.zeros(100))]
        send_buffers(sock, [memoryview(encode_head("Echo", {}, entries, shared=True))])
        head = Reader(sock).read_head(max_body_bytes=1 << 20)
        assert head.kind == "INVALID_ARGUMENT" and "no segment attached" in head.meta["message"]
    channel = _channel(server, shared_memory=True)
    try:
        assert torch.equal(channel.call("Echo", {}, {"t": torch.ones(BIG)})[1]["t"], torch.ones(BIG))
    finally:
        channel.close()


def test_an_attach_naming_another_file_is_refused(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        frame.send_message(sock, "Attach", {"path": "/etc/passwd", "nonce": "00", "request_bytes": 8,
                                            "reply_bytes": 8})
        head = Reader(sock).read_head(max_body_bytes=1 << 20)
        assert head.kind == "INVALID_ARGUMENT" and "tensorfleet segment" in head.meta["message"]
        frame.send_message(sock, "Echo", {"still": "served"})  # the connection stays usable
        assert Reader(sock).read_head(max_body_bytes=1 << 20).meta == {"still": "served", "shared": False}


def test_a_refused_attach_leaves_the_channel_on_tcp(server, monkeypatch):
    """A segment the server cannot open (as from another host): the channel says so once and stays on TCP."""
    real_attach = shm.Segment.attach

    def elsewhere(path, *args, **kwargs):
        return real_attach(f"{shm.SHM_DIR}/tensorfleet-1-{'0' * 16}", *args, **kwargs)

    monkeypatch.setattr(shm.Segment, "attach", staticmethod(elsewhere))
    channel = _channel(server, shared_memory=True)
    try:
        for _ in range(2):
            meta, got = channel.call("Echo", {}, {"t": torch.full((BIG,), 3.0)})
            assert not meta["shared"] and torch.equal(got["t"], torch.full((BIG,), 3.0))
        assert not channel.shared and not _our_segments()
    finally:
        channel.close()


class _Addresses:
    def __init__(self, peer: str, local: str) -> None:
        self.peer, self.local = peer, local

    def getpeername(self):
        return self.peer, 1

    def getsockname(self):
        return self.local, 2


@pytest.mark.parametrize("peer,local,same", [("127.0.0.1", "127.0.0.1", True), ("127.0.0.1", "127.0.0.2", True),
                                             ("::1", "::1", True), ("10.0.0.5", "10.0.0.5", True),
                                             ("10.0.0.6", "10.0.0.5", False)])
def test_only_a_peer_on_this_host_is_offered_a_segment(peer, local, same):
    assert _same_host(_Addresses(peer, local)) is same
