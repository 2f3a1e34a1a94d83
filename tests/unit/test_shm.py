"""Shared segments for data-plane bodies: both sides see one memory, and a server maps only what it should."""

import errno
import fcntl
import os

import pytest
import torch

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.wire import shm

pytestmark = pytest.mark.skipif(not shm.SUPPORTED, reason="no sealable memfd on this host")
DEAD_PID = 2 ** 22 + 12345  # above the kernel's pid limit: never alive

MAX = 1 << 30


@pytest.fixture
def segment():
    created = shm.Segment.create(1000, 3000)
    assert created is not None
    yield created
    created.unlink()


def attach(segment, **overrides):
    args = {"path": segment.path, "nonce_hex": segment.nonce.hex(), "request_bytes": segment.request_bytes,
            "reply_bytes": segment.reply_bytes, "max_area_bytes": MAX, **overrides}
    return shm.Segment.attach(args.pop("path"), args.pop("nonce_hex"), args.pop("request_bytes"),
                              args.pop("reply_bytes"), **args)


def _memfds() -> set[str]:
    """This process's descriptors of tensorfleet segments."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tensorfleet-"):
                found.add(fd)
        except OSError:
            pass
    return found


def test_both_sides_share_the_areas_and_the_name_can_go_at_once(segment):
    assert segment.path == f"/proc/{os.getpid()}/fd/{segment._fd}"
    server = attach(segment)
    segment.unlink()
    assert not os.path.exists(segment.path)  # the mappings outlive the descriptor
    segment.request[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    server.reply[-2:] = torch.tensor([9, 8], dtype=torch.uint8)
    assert server.request[:4].tolist() == [1, 2, 3, 4]
    assert segment.reply[-2:].tolist() == [9, 8]
    assert (segment.request.numel(), segment.reply.numel()) == (1000, 3000)
    assert segment.request.data_ptr() % shm.ALIGN == 0 and segment.reply.data_ptr() % shm.ALIGN == 0


def test_the_segment_is_a_private_memfd_that_no_one_can_shrink_or_grow(segment):
    assert os.stat(segment.path).st_mode & 0o777 == 0o600
    assert os.readlink(segment.path).startswith("/memfd:tensorfleet-")  # no file in /dev/shm or anywhere
    seals = fcntl.fcntl(segment._fd, fcntl.F_GET_SEALS)
    assert seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) == \
        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    fd = os.open(segment.path, os.O_RDWR)  # as the server (or anyone of this user) opens it
    try:
        for size in (0, shm.segment_bytes(1000, 3000) + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)  # F_SEAL_SEAL: not even the seals can change
    finally:
        os.close(fd)


@pytest.mark.parametrize("path", ["/etc/passwd", "/dev/shm/tensorfleet-1-0123456789abcdef", "/proc/self/fd/3",
                                  "/proc/01/fd/3", "/proc/1/fd/03", "/proc/1/fd/-3", "/proc/1/fd/3/",
                                  "/proc/1/fd/3/../../../etc/passwd", "/proc/1/fd/x", "/proc/1/fd/", "/proc/1/fd/3\n",
                                  "//proc/1/fd/3", "proc/1/fd/3", "relative", 7, None])
def test_a_server_maps_nothing_but_a_tensorfleet_segment(segment, path):
    with pytest.raises(InvalidArgumentError, match="must name a tensorfleet segment"):
        attach(segment, path=path)


@pytest.mark.parametrize("field,value", [("request_bytes", -1), ("request_bytes", True), ("reply_bytes", "8"),
                                         ("reply_bytes", MAX + 1)])
def test_sizes_must_be_integers_within_the_limit(segment, field, value):
    with pytest.raises(InvalidArgumentError, match=field):
        attach(segment, **{field: value})


def test_a_segment_whose_size_or_nonce_differs_from_the_claim_is_refused(segment):
    with pytest.raises(InvalidArgumentError, match="holds .* bytes"):
        attach(segment, reply_bytes=segment.reply_bytes + 1000)
    with pytest.raises(InvalidArgumentError, match="nonce"):
        attach(segment, nonce_hex=os.urandom(16).hex())
    with pytest.raises(InvalidArgumentError, match="must be hex"):
        attach(segment, nonce_hex="not hex")


def test_a_segment_of_another_host_is_not_found(segment):
    """A client on another machine (or in another pid namespace): no such process here, and it stays on TCP."""
    with pytest.raises(InvalidArgumentError, match="not on this host"):
        attach(segment, path=f"/proc/{DEAD_PID}/fd/{segment._fd}")
    with pytest.raises(InvalidArgumentError, match="not on this host"):
        attach(segment, path=f"/proc/{os.getpid()}/fd/999999")  # the process, but no such descriptor


def test_a_descriptor_that_is_not_a_tensorfleet_memfd_is_refused(segment, tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(bytes(shm.segment_bytes(1000, 3000)))
    fd = os.open(plain, os.O_RDONLY)
    other = os.memfd_create("other", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(other, shm.segment_bytes(1000, 3000))
        for descriptor in (fd, other):
            with pytest.raises(InvalidArgumentError, match="not a tensorfleet shared segment"):
                attach(segment, path=f"/proc/{os.getpid()}/fd/{descriptor}")
    finally:
        os.close(fd)
        os.close(other)


@pytest.mark.parametrize("seals", ["none", "grow", "write_only", "unsealable"])
def test_a_segment_that_could_still_shrink_is_refused(seals):
    """A peer's memfd with the right name, size and nonce, but without F_SEAL_SHRINK: the peer could truncate
    it under the server's mapping (SIGBUS), so the server does not map it."""
    size = shm.segment_bytes(1000, 3000)
    sealing = 0 if seals == "unsealable" else os.MFD_ALLOW_SEALING  # without it: F_SEAL_SEAL alone, for good
    fd = os.memfd_create(f"tensorfleet-{os.getpid()}", os.MFD_CLOEXEC | sealing)
    try:
        os.ftruncate(fd, size)
        nonce = os.urandom(16)
        os.pwrite(fd, shm.MAGIC + nonce, 0)
        if seals == "grow":
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        elif seals == "write_only":
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        before = _memfds()
        with pytest.raises(InvalidArgumentError, match="F_SEAL_SHRINK"):
            shm.Segment.attach(f"/proc/{os.getpid()}/fd/{fd}", nonce.hex(), 1000, 3000, max_area_bytes=MAX)
        assert _memfds() == before  # nothing opened or mapped is left behind
    finally:
        os.close(fd)


def test_the_same_segment_sealed_against_shrinking_is_accepted():
    """The counterpart of the test above: only the seal differs."""
    fd = os.memfd_create(f"tensorfleet-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, shm.segment_bytes(1000, 3000))
        nonce = os.urandom(16)
        os.pwrite(fd, shm.MAGIC + nonce, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        server = shm.Segment.attach(f"/proc/{os.getpid()}/fd/{fd}", nonce.hex(), 1000, 3000, max_area_bytes=MAX)
        os.pwrite(fd, b"\x05", shm.HEADER_BYTES)
        assert server.request[0].item() == 5
    finally:
        os.close(fd)


def test_a_full_shared_memory_gives_none_and_leaves_nothing_open(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    before = _memfds()
    assert shm.Segment.create(1 << 20, 1 << 20) is None
    assert _memfds() == before


def test_unlink_closes_the_descriptor_once(segment):
    segment.unlink()
    segment.unlink()  # DataChannel._attach's finally may follow an earlier close
    assert segment._fd is None
