"""Shared segments for data-plane bodies: both sides see one memory, and a server maps only what it should."""

import errno
import os

import pytest
import torch

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.wire import shm

pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm on this host")

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


def test_both_sides_share_the_areas_and_the_name_can_go_at_once(segment):
    server = attach(segment)
    segment.unlink()
    assert not os.path.exists(segment.path)  # the mappings outlive the name
    segment.request[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    server.reply[-2:] = torch.tensor([9, 8], dtype=torch.uint8)
    assert server.request[:4].tolist() == [1, 2, 3, 4]
    assert segment.reply[-2:].tolist() == [9, 8]
    assert (segment.request.numel(), segment.reply.numel()) == (1000, 3000)
    assert segment.request.data_ptr() % shm.ALIGN == 0 and segment.reply.data_ptr() % shm.ALIGN == 0


def test_the_file_is_private_to_its_user(segment):
    assert os.stat(segment.path).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("path", ["/etc/passwd", "/dev/shm/other-123-0123456789abcdef", "/dev/shm/../etc/passwd",
                                  "/dev/shm/tensorfleet-1-0123456789abcdef/x", "relative", 7, None])
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
    """Another machine's /dev/shm: the name does not exist here, and the client stays on TCP."""
    with pytest.raises(InvalidArgumentError, match="not on this host"):
        attach(segment, path=f"{shm.SHM_DIR}/tensorfleet-1-{os.urandom(8).hex()}")


def test_a_symlink_is_not_followed(segment, tmp_path):
    link = f"{shm.SHM_DIR}/tensorfleet-{os.getpid()}-{os.urandom(8).hex()}"
    os.symlink(segment.path, link)
    try:
        with pytest.raises(InvalidArgumentError, match="not on this host"):
            attach(segment, path=link)
    finally:
        os.unlink(link)


def test_a_full_shared_memory_gives_none_and_leaves_no_file(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    before = set(os.listdir(shm.SHM_DIR))
    assert shm.Segment.create(1 << 20, 1 << 20) is None
    assert set(os.listdir(shm.SHM_DIR)) == before


def test_segments_of_dead_creators_are_swept_once(monkeypatch):
    dead_pid = 2 ** 22 + 12345  # above the kernel's pid limit: never alive
    stale = f"{shm.SHM_DIR}/tensorfleet-{dead_pid}-{os.urandom(8).hex()}"
    live = f"{shm.SHM_DIR}/tensorfleet-{os.getpid()}-{os.urandom(8).hex()}"
    for path in (stale, live):
        open(path, "wb").close()
    try:
        monkeypatch.setattr(shm, "_swept", False)
        shm.sweep_stale()
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)
