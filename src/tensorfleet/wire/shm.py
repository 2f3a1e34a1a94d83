"""Shared memory for the bodies of data-plane messages between two tasks on one host.

Over loopback TCP each byte is copied into the kernel and out again, with a system call per
piece: moving 64 MiB costs ~35 ms of CPU on the 2-core test machines, where one memcpy takes
~5 ms.  A ps and its workers on one machine (``tensorfleet launch``) spend most of a large
model's step there.  So a data connection between tasks on one host moves its bodies
through a shared segment instead; the socket still carries every message's head, which
keeps the order, the deadlines and the errors exactly as they are.

One ``Segment`` per connection: an anonymous memory file (``memfd_create``) that the
client sizes, seals against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL``), maps and fills with a random nonce.  It has no name in any directory:
nothing is ever created in ``/dev/shm``, so nothing is left behind when either side dies
and there is nothing to sweep.  The client announces it (the ``Attach`` request) by the
path of its own descriptor, ``/proc/<client pid>/fd/<fd>``; the server opens that path
(the kernel opens it only for a process that may inspect the client: the same user, the
same pid namespace; anything else is refused and the connection stays on TCP),
checks that what it opened is a tensorfleet memfd of this user, sealed against
shrinking, of the announced size and carrying the announced nonce, and maps it.  The
client then closes its descriptor: the mappings keep the memory alive.  Layout::

    [64-byte header: MAGIC, nonce] [request area] [reply area]       (areas 64-byte aligned)

A head flagged ``shared`` (``tensorfleet.wire.frame``) says its body starts at offset 0
of the sender's area.  One request at a time per connection makes reuse safe: the
client writes the request area only once the previous reply has arrived, and the
server writes the reply area only while it serves a request.  A body that does not
fit the area travels over the socket as before.

Trust: a segment is shared with one peer that has passed the connection's checks
(the job token, when there is one) and runs as the same user.  Such a peer could
rewrite a body while the server reads it, as it could send other bytes; the server
never reads or writes beyond the areas it has checked.  What it must not be able to do
is take the server down: a file shrunk under a mapping turns the next access past its
new end into SIGBUS, which kills the whole process.  So the server maps only a memfd
that carries ``F_SEAL_SHRINK`` (seals cannot be removed once set): no one, not even its
creator, can truncate it while the server holds it.  (A plain file in ``/dev/shm``, as
used before, could be truncated by its creator at any time.)
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import stat

import torch

from tensorfleet.errors import InvalidArgumentError

log = logging.getLogger(__name__)

NAME_PREFIX = "tensorfleet-"  # the memfd's name (what /proc shows as "/memfd:tensorfleet-<pid> (deleted)")
MAGIC = b"TFLSHM01"
HEADER_BYTES = 64
ALIGN = 64
_PATH = re.compile(r"/proc/([1-9][0-9]{0,9})/fd/(0|[1-9][0-9]{0,9})")  # decimal pid and fd, nothing else
_MEMFD_TARGET = "/memfd:" + NAME_PREFIX  # what readlink() gives for one of our segments
_NONCE_BYTES = 16
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0) | getattr(fcntl, "F_SEAL_SEAL", 0)
# Opening a client's descriptor must never block or take a terminal, whatever the path turns out to be.
_OPEN_FLAGS = os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

SUPPORTED = hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING") and hasattr(fcntl, "F_ADD_SEALS")
"""Whether this platform has sealable memfds (Linux); without them every connection stays on TCP."""


def _round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def segment_bytes(request_bytes: int, reply_bytes: int) -> int:
    """The file size of a segment with these areas."""
    return HEADER_BYTES + _round_up(request_bytes) + _round_up(reply_bytes)


class Segment:
    """One mapped segment: ``request`` and ``reply`` are its two areas, as uint8 tensors.

    ``path`` is how the server opens it: ``/proc/<client pid>/fd/<fd>``, valid while the client
    holds the descriptor (until ``unlink``).
    """

    def __init__(self, path: str, mapping: mmap.mmap, nonce: bytes, request_bytes: int, reply_bytes: int,
                 fd: int | None = None) -> None:
        self.path, self.nonce = path, nonce
        self.request_bytes, self.reply_bytes = request_bytes, reply_bytes
        self._fd = fd  # the client's descriptor, which ``path`` names; None on the server and once closed
        whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view
        reply_at = HEADER_BYTES + _round_up(request_bytes)
        self.request = whole[HEADER_BYTES:HEADER_BYTES + request_bytes]
        self.reply = whole[reply_at:reply_at + reply_bytes]

    @classmethod
    def create(cls, request_bytes: int, reply_bytes: int) -> "Segment | None":
        """A new segment (client side), sealed so that it can never shrink; None where this host has
        no sealable memfds or no room."""
        if not SUPPORTED or not hasattr(os, "posix_fallocate"):  # not Linux: TCP only
            return None
        size = segment_bytes(request_bytes, reply_bytes)
        try:
            fd = os.memfd_create(f"{NAME_PREFIX}{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            log.debug("no shared memory for data connections (%s): using TCP", exc)
            return None
        try:
            os.fchmod(fd, 0o600)
            # Reserve the pages now: where memory is short (a container's limit) touching an unreserved
            # page later fails inside a copy, where this is a clean ENOSPC/ENOMEM.
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            log.debug("no room for %d bytes of shared memory (%s): using TCP", size, exc)
            return None
        nonce = secrets.token_bytes(_NONCE_BYTES)
        mapping[:len(MAGIC) + _NONCE_BYTES] = MAGIC + nonce
        return cls(f"/proc/{os.getpid()}/fd/{fd}", mapping, nonce, request_bytes, reply_bytes, fd=fd)

    @classmethod
    def attach(cls, path: str, nonce_hex: str, request_bytes: int, reply_bytes: int, *,
               max_area_bytes: int) -> "Segment":
        """Map a client's segment (server side), after checking everything the client claims.

        Raises:
            InvalidArgumentError: a malformed request (a path that is not ``/proc/<pid>/fd/<fd>``, bad sizes),
                or a segment this task cannot or must not use (a client on another host or in another pid
                namespace, one this task may not inspect, anything but a tensorfleet memfd of this user, one
                that could still shrink, a size or nonce that does not match): the client then stays on TCP.
        """
        if not isinstance(path, str) or not _PATH.fullmatch(path):
            raise InvalidArgumentError(f"Attach 'path' must name a tensorfleet segment as /proc/<pid>/fd/<fd>, "
                                       f"got {path!r:.80}")
        for name, value in (("request_bytes", request_bytes), ("reply_bytes", reply_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= max_area_bytes:
                raise InvalidArgumentError(f"Attach {name!r} must be an integer in 0..{max_area_bytes}, "
                                           f"got {value!r:.40}")
        try:
            nonce = bytes.fromhex(nonce_hex)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"Attach 'nonce' must be hex, got {nonce_hex!r:.40}") from None
        if not SUPPORTED:
            raise InvalidArgumentError("this task has no sealable shared memory: staying on TCP")
        try:
            # Look before opening: a client's descriptor may be a device whose open() has effects.
            if not os.readlink(path).startswith(_MEMFD_TARGET):
                raise InvalidArgumentError(f"{path} is not a tensorfleet shared segment; staying on TCP")
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot open the shared segment {path} ({exc.strerror}): not on this "
                                       "host, or not a process this task may inspect; staying on TCP") from None
        try:
            # What was opened, not what the path named a moment before (the client may have replaced it).
            if not os.readlink(f"/proc/self/fd/{fd}").startswith(_MEMFD_TARGET):
                raise InvalidArgumentError(f"{path} is not a tensorfleet shared segment; staying on TCP")
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise InvalidArgumentError(f"{path} is not a memory file of this user; staying on TCP")
            if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise InvalidArgumentError(f"{path} is not sealed against shrinking (F_SEAL_SHRINK): it could be "
                                           "truncated under this task's mapping; staying on TCP")
            size = segment_bytes(request_bytes, reply_bytes)
            if info.st_size != size:  # sealed: the size can no longer change from here on
                raise InvalidArgumentError(f"{path} holds {info.st_size} bytes, not the {size} announced")
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot map the shared segment {path} ({exc.strerror}); "
                                       "staying on TCP") from None
        finally:
            os.close(fd)
        if mapping[:len(MAGIC) + _NONCE_BYTES] != MAGIC + nonce:
            mapping.close()
            raise InvalidArgumentError(f"{path} does not carry the announced nonce: another process's segment; "
                                       "staying on TCP")
        return cls(path, mapping, nonce, request_bytes, reply_bytes)

    def unlink(self) -> None:
        """Close the client's descriptor, the segment's only name (once the server has answered its Attach):
        the mappings stay, and the memory goes with the last of them."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
