"""Shared memory for the bodies of data-plane messages between two tasks on one host.

Over loopback TCP each byte is copied into the kernel and out again, with a system call per
piece: moving 64 MiB costs ~35 ms of CPU on the 2-core test machines, where one memcpy takes
~5 ms.  A ps and its workers on one machine (``tensorfleet launch``) spend most of a large
model's step there.  So a data connection between tasks on one host moves its bodies
through a shared segment instead; the socket still carries every message's head, which
keeps the order, the deadlines and the errors exactly as they are.

One ``Segment`` per connection: a file in ``/dev/shm`` (mode 0600) that the client
creates and fills with a random nonce, and the server attaches (the ``Attach`` request)
after checking its name, owner, size and nonce.  The client then unlinks the file: the
mappings outlive the name, so nothing is left behind when either side dies.  Layout::

    [64-byte header: MAGIC, nonce] [request area] [reply area]       (areas 64-byte aligned)

A head flagged ``shared`` (``tensorfleet.wire.frame``) says its body starts at offset 0
of the sender's area.  One request at a time per connection makes reuse safe: the
client writes the request area only once the previous reply has arrived, and the
server writes the reply area only while it serves a request.  A body that does not
fit the area travels over the socket as before.

Trust: a segment is shared with one peer that has passed the connection's checks
(the job token, when there is one) and runs as the same user.  Such a peer could
rewrite a body while the server reads it, as it could send other bytes; the server
never reads or writes beyond the areas it has checked.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat

import torch

from tensorfleet.errors import InvalidArgumentError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "tensorfleet-"
MAGIC = b"TFLSHM01"
HEADER_BYTES = 64
ALIGN = 64
_NAME = re.compile(r"tensorfleet-(\d+)-[0-9a-f]{16}")
_NONCE_BYTES = 16


def _round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def segment_bytes(request_bytes: int, reply_bytes: int) -> int:
    """The file size of a segment with these areas."""
    return HEADER_BYTES + _round_up(request_bytes) + _round_up(reply_bytes)


class Segment:
    """One mapped segment: ``request`` and ``reply`` are its two areas, as uint8 tensors."""

    def __init__(self, path: str, mapping: mmap.mmap, nonce: bytes, request_bytes: int, reply_bytes: int) -> None:
        self.path, self.nonce = path, nonce
        self.request_bytes, self.reply_bytes = request_bytes, reply_bytes
        whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view
        reply_at = HEADER_BYTES + _round_up(request_bytes)
        self.request = whole[HEADER_BYTES:HEADER_BYTES + request_bytes]
        self.reply = whole[reply_at:reply_at + reply_bytes]

    @classmethod
    def create(cls, request_bytes: int, reply_bytes: int) -> "Segment | None":
        """A new segment (client side); None where this host has no room or no ``/dev/shm``."""
        if not hasattr(os, "posix_fallocate"):  # not Linux: no tmpfs /dev/shm to rely on
            return None
        sweep_stale()
        path = os.path.join(SHM_DIR, f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        size = segment_bytes(request_bytes, reply_bytes)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            log.debug("no shared memory for data connections (%s): using TCP", exc)
            return None
        try:
            # Reserve the pages now: on a full tmpfs (a container's 64 MB /dev/shm) touching an
            # unreserved page later is a SIGBUS, where this is a clean ENOSPC.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            _unlink(path)
            log.debug("no room for %d bytes of shared memory (%s): using TCP", size, exc)
            return None
        os.close(fd)
        nonce = secrets.token_bytes(_NONCE_BYTES)
        mapping[:len(MAGIC) + _NONCE_BYTES] = MAGIC + nonce
        return cls(path, mapping, nonce, request_bytes, reply_bytes)

    @classmethod
    def attach(cls, path: str, nonce_hex: str, request_bytes: int, reply_bytes: int, *,
               max_area_bytes: int) -> "Segment":
        """Map a client's segment (server side), after checking everything the client claims.

        Raises:
            InvalidArgumentError: a malformed request (a path that is not a tensorfleet segment, bad sizes),
                or a segment this task cannot use (another host's /dev/shm, another user's file, a nonce
                that does not match): the client then stays on TCP.
        """
        if not isinstance(path, str) or os.path.dirname(path) != SHM_DIR \
                or not _NAME.fullmatch(os.path.basename(path)):
            raise InvalidArgumentError(f"Attach 'path' must name a tensorfleet segment in {SHM_DIR}, "
                                       f"got {path!r:.80}")
        for name, value in (("request_bytes", request_bytes), ("reply_bytes", reply_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= max_area_bytes:
                raise InvalidArgumentError(f"Attach {name!r} must be an integer in 0..{max_area_bytes}, "
                                           f"got {value!r:.40}")
        try:
            nonce = bytes.fromhex(nonce_hex)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"Attach 'nonce' must be hex, got {nonce_hex!r:.40}") from None
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot open the shared segment {path} ({exc.strerror}): "
                                          "not on this host; staying on TCP") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise InvalidArgumentError(f"{path} is not a regular file of this user; staying on TCP")
            size = segment_bytes(request_bytes, reply_bytes)
            if info.st_size != size:
                raise InvalidArgumentError(f"{path} holds {info.st_size} bytes, not the {size} announced")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if mapping[:len(MAGIC) + _NONCE_BYTES] != MAGIC + nonce:
            mapping.close()
            raise InvalidArgumentError(f"{path} does not carry the announced nonce: another host's segment of "
                                          "the same name; staying on TCP")
        return cls(path, mapping, nonce, request_bytes, reply_bytes)

    def unlink(self) -> None:
        """Remove the name (the client, once the server has answered its Attach); the mappings stay."""
        _unlink(self.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_swept = False


def sweep_stale() -> None:
    """Once per process: remove this user's segments whose creator has died between creating and
    attaching them (a name normally lives for one round trip)."""
    global _swept
    if _swept:
        return
    _swept = True
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        found = _NAME.fullmatch(name)
        if found is None or _alive(int(found.group(1))):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: not ours to judge
    return True
