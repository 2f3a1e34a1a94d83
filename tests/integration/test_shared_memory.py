"""Bodies through shared memory between tasks on one host: used when it can be, refused cleanly when not,
and never trusted beyond what was attached."""

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from tensorfleet.errors import UnavailableError
from tensorfleet.wire import frame, shm
from tensorfleet.wire.datachannel import SHARED_MIN_BYTES, DataChannel, _same_host
from tensorfleet.wire.dataplane import Reply
from tensorfleet.wire.dataserver import DataServer
from tensorfleet.wire.frame import Reader, encode_head, send_buffers
from tensorfleet.wire.rpc import WireOptions

pytestmark = pytest.mark.skipif(not shm.SUPPORTED, reason="no sealable memfd on this host")

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
    """This process's descriptors of tensorfleet segments (a mapping holds one), and any file of ours in /dev/shm."""
    found = set(_files_in_dev_shm())
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{shm.NAME_PREFIX}"):
                found.add(fd)
        except OSError:
            pass
    return found


def _files_in_dev_shm() -> list[str]:
    """Segments of this process with a name in /dev/shm: there should never be one (a segment is a memfd)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return [name for name in names if name.startswith(f"{shm.NAME_PREFIX}{os.getpid()}-")]


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
        assert channel._segment._fd is None and not os.path.exists(channel._segment.path)  # closed once attached
        assert not _files_in_dev_shm()
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
    before = _our_segments()
    server = DataServer("127.0.0.1", {"Echo": _echo}, task="echo",
                        options=WireOptions(shared_memory=side != "server"))
    channel = _channel(server, shared_memory=side != "client")
    try:
        sent = {"t": torch.randn(BIG)}
        for _ in range(2):
            meta, got = channel.call("Echo", {}, sent)
            assert not meta["shared"] and not channel.shared
            assert torch.equal(got["t"], sent["t"])
        assert _our_segments() <= before
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


@pytest.mark.parametrize("path", ["/etc/passwd", "/dev/shm/tensorfleet-1-0123456789abcdef",
                                  f"/proc/{os.getpid()}/fd/0"])  # the server's own stdin: not a segment
def test_an_attach_naming_another_file_is_refused(server, path):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        frame.send_message(sock, "Attach", {"path": path, "nonce": "00", "request_bytes": 8, "reply_bytes": 8})
        head = Reader(sock).read_head(max_body_bytes=1 << 20)
        assert head.kind == "INVALID_ARGUMENT" and "tensorfleet" in head.meta["message"]
        frame.send_message(sock, "Echo", {"still": "served"})  # the connection stays usable
        assert Reader(sock).read_head(max_body_bytes=1 << 20).meta == {"still": "served", "shared": False}


def test_a_refused_attach_leaves_the_channel_on_tcp(server, monkeypatch):
    """A segment the server cannot open (as from another host): the channel says so once and stays on TCP."""
    real_attach = shm.Segment.attach
    before = _our_segments()

    def elsewhere(path, *args, **kwargs):
        return real_attach(f"/proc/{2 ** 22 + 12345}/fd/3", *args, **kwargs)  # no such process here

    monkeypatch.setattr(shm.Segment, "attach", staticmethod(elsewhere))
    channel = _channel(server, shared_memory=True)
    try:
        for _ in range(2):
            meta, got = channel.call("Echo", {}, {"t": torch.full((BIG,), 3.0)})
            assert not meta["shared"] and torch.equal(got["t"], torch.full((BIG,), 3.0))
        assert not channel.shared and _our_segments() <= before
    finally:
        channel.close()


SERVER_PROCESS = textwrap.dedent("""
    import time
    from tensorfleet.wire.dataplane import Reply
    from tensorfleet.wire.dataserver import DataServer
    from tensorfleet.wire.rpc import WireOptions
    server = DataServer("127.0.0.1", {"Echo": lambda r: Reply(r.meta, r.receive())}, task="echo",
                        options=WireOptions(shared_memory=True))
    print(server.port, flush=True)
    time.sleep(120)
""")


@pytest.mark.cluster
def test_a_client_truncating_its_segment_cannot_kill_the_server(monkeypatch):
    """Security review: the peer (same user) truncates the segment the server has mapped.  With a file in
    /dev/shm the server's next access to the mapping was SIGBUS, and the whole process (a ps) died.  The
    segment is now a memfd sealed against shrinking: the truncation fails, and the server keeps serving."""
    process = subprocess.Popen([sys.executable, "-c", SERVER_PROCESS], stdout=subprocess.PIPE, text=True)
    opened: list[int] = []  # the attacker's descriptors of the segment, opened by the path the server was given
    real_unlink = shm.Segment.unlink

    def open_then_unlink(segment):
        opened.append(os.open(segment.path, os.O_RDWR))  # while the path still leads to the segment
        real_unlink(segment)

    monkeypatch.setattr(shm.Segment, "unlink", open_then_unlink)
    channel = DataChannel(task="echo", options=WireOptions(shared_memory=True))
    try:
        channel.set_address("127.0.0.1", int(process.stdout.readline()))
        sent = torch.randn(BIG)
        for _ in range(2):  # the second call attaches a segment with a reply area too
            meta, got = channel.call("Echo", {}, {"t": sent})
            assert channel.shared and torch.equal(got["t"], sent)  # the request went through the segment
        assert channel._segment.reply_bytes >= BIG * 4 and len(opened) == 2
        try:
            os.ftruncate(opened[-1], 0)  # what an attacker (or a buggy peer) does
            truncated = True
        except PermissionError:
            truncated = False
        # The server reads the request area again and writes its reply into the reply area, without this
        # process touching its own (maybe truncated) mapping first: a head claiming a shared body, as the client
        # sends after writing the area (which still holds ``sent``).
        entries = [frame.TensorEntry.of("t", sent)]
        send_buffers(channel._sock, [memoryview(encode_head("Echo", {"again": 1}, entries, shared=True))])
        try:
            reply = channel._read_reply(None)
        except (UnavailableError, OSError):
            reply = None
            try:
                process.wait(timeout=10)  # the connection closes as the process dies, a moment before it is reaped
            except subprocess.TimeoutExpired:
                pass
        process.poll()
        assert reply is not None and process.returncode is None, (
            f"the server died ({'SIGBUS' if process.returncode == -signal.SIGBUS else process.returncode}) after "
            f"its client {'truncated' if truncated else 'tried to truncate'} the shared segment")
        assert not truncated, "the segment could be truncated under the server's mapping"
        assert reply.kind == "OK" and reply.meta == {"again": 1} and torch.equal(reply.tensors["t"], sent)
        for scale in (1, 2, 1):  # on this connection and segment (which grows), then on a new one
            sent = torch.randn(BIG * scale)
            meta, got = channel.call("Echo", {"n": scale}, {"t": sent})
            assert meta == {"n": scale} and torch.equal(got["t"], sent) and channel.shared
            if scale == 2:
                channel.close()
        assert process.poll() is None
    finally:
        channel.close()
        for fd in opened:
            os.close(fd)
        process.kill()
        process.wait(timeout=10)
        process.stdout.close()


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


def test_what_the_server_receives_from_shared_memory_is_out_of_the_clients_reach():
    """Security review (issue 28, item 5): a dense push read from the shared segment was checked for NaN, then
    read again by the optimizer; the client flipped a value in between and put NaN into the ps. What a server
    receives is now a copy: a write to the segment after ``receive()`` (the client's, at any moment) reaches
    nothing the server checked."""
    def check_then_use(request):
        received = request.receive()
        checked = bool(torch.isfinite(received["g"]).all())
        request._reader.shared_area.data.fill_(0xFF)  # the client writes NaN there now: 0xFFFFFFFF is a NaN
        used = received["g"]
        return Reply({"checked_finite": checked, "used_finite": bool(torch.isfinite(used).all()),
                      "shared": request._shared})

    server = DataServer("127.0.0.1", {"Push": check_then_use}, task="echo", options=WireOptions(shared_memory=True))
    channel = _channel(server, shared_memory=True)
    try:
        for _ in range(2):  # the first call attaches the segment; both go through it
            meta, _ = channel.call("Push", {}, {"g": torch.ones(BIG)})
            assert meta == {"checked_finite": True, "used_finite": True, "shared": True}
    finally:
        channel.close()
        server.stop()
