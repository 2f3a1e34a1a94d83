"""Messages of the data plane on a byte stream: a fixed prefix, a JSON header, then raw tensor bytes.

Layout of one message::

    b"TFLD" | u8 version | u8 flags | 2 bytes zero | u32 header length | u64 body length   (little endian, 20 bytes)
    header: UTF-8 JSON {"kind": str, "meta": {...}, "tensors": [{"name", "dtype", "shape"}, ...]}
    body:   the tensors' bytes, one after another in header order, no padding

With the flag ``SHARED`` the body is not on the stream but at the start of the sender's
area of the connection's shared segment (``tensorfleet.wire.shm``, tasks on one host).

``kind`` is the method of a request (``"Push"``) or the status of a reply (``"OK"``
or an error code such as ``"INVALID_ARGUMENT"``, with ``meta["message"]``).

Unlike ``codec`` (one bytes object per message, for gRPC), nothing here builds the
whole message in memory: ``send_message`` hands the kernel the tensors' own memory
(scatter-gather ``sendmsg``), and ``read_head`` + ``recv_into`` put the body straight
into tensors the receiver chose (a ps's gradient buffers, a worker's parameters).
The header is read and validated before a byte of the body is, so a bad request
can be refused (and its body skipped) without touching any tensor.  No pickle.

The same functions serve a connection wrapped in TLS (``ssl.SSLSocket``, when the job has
certificates): it has no ``sendmsg`` and takes no flags on a receive, so its buffers go out
through ``sendall`` (small ones joined), its reader never polls, and its bounds are Python's
own timeout (``set_io_timeouts``).
"""

from __future__ import annotations

import functools
import json
import math
import select
import socket
import ssl
import struct
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from tensorfleet.errors import UnavailableError, WireError
from tensorfleet.wire.codec import TensorEntry, byte_view, check_entry

MAGIC = b"TFLD"
VERSION = 1
PREFIX = struct.Struct("<4sBB2xIQ")
SHARED = 0x01  # flags: the body is in the connection's shared segment
MAX_HEADER_BYTES = 4 * 1024 * 1024
IOV_MAX = 512  # buffers per sendmsg call, well under the kernel's 1024
# Small messages arrive in one recv; larger bodies bypass the buffer.  Kept small: a head is read with
# whatever of the body follows it, and that part is then copied out of the buffer.
READ_BUFFER_BYTES = 64 * 1024
# With TLS: buffers up to this size are joined into one write (a head and a small body: one record, one
# syscall), and larger ones are written in pieces of TLS_SEND_BYTES, each with the whole send bound
# (Python bounds one SSL write as a whole, not its progress).
TLS_JOIN_BYTES = 16 * 1024
TLS_SEND_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Head:
    """A message's prefix and header, validated; the body is still on the wire."""

    kind: str
    meta: dict[str, Any]
    entries: list[TensorEntry]
    body_bytes: int
    shared: bool = False  # the body is in the sender's shared area, not on the stream


_JSON = json.JSONEncoder(separators=(",", ":"))  # one instance: json.dumps with options builds one per call


def encode_head(kind: str, meta: Mapping[str, Any] | None, entries: list[TensorEntry], *,
                shared: bool = False) -> bytes:
    """Prefix + header of a message whose body is the bytes of ``entries``' tensors, in order."""
    layout, body_bytes = _encode_layout(tuple(entries))
    header = f'{{"kind":{_JSON.encode(kind)},"meta":{_JSON.encode(dict(meta or {}))},"tensors":{layout}}}'.encode()
    return PREFIX.pack(MAGIC, VERSION, SHARED if shared else 0, len(header), body_bytes) + header


def body_size(entries: list[TensorEntry]) -> int:
    """The bytes of a body holding these tensors."""
    return _encode_layout(tuple(entries))[1]


@functools.lru_cache(maxsize=1024)
def _encode_layout(entries: tuple[TensorEntry, ...]) -> tuple[str, int]:
    """The header's tensor list and the body's size: the same every step for a given model, so cached."""
    return _JSON.encode([entry.to_json() for entry in entries]), sum(entry.nbytes for entry in entries)


def send_message(sock: socket.socket, kind: str, meta: Mapping[str, Any] | None = None,
                 tensors: Mapping[str, torch.Tensor] | None = None, *, area: SharedArea | None = None,
                 release: Callable[[], None] | None = None, staging: Staging | None = None) -> None:
    """Send one whole message; the tensors' memory goes to the kernel without a copy.

    With ``area`` (this side's area of a shared segment) a body that fits is copied there
    instead, and only the head goes on the stream.  With ``release`` the tensors are only
    borrowed (a ps's live variables under a read hold): they are copied (into the area, or into
    ``staging``) and ``release`` is called *before* anything is sent, so a peer that stops
    reading can stall this connection only, never the variables' updates.
    """
    tensors = tensors or {}
    entries = [TensorEntry.of(name, tensor) for name, tensor in tensors.items()]
    if area is not None and 0 < body_size(entries) <= area.nbytes:
        area.write(tuple(entries), tensors.values())
        if release is not None:
            release()
        send_buffers(sock, [memoryview(encode_head(kind, meta, entries, shared=True))])
        return
    buffers = [memoryview(encode_head(kind, meta, entries))]
    if release is not None:
        buffers.append((staging or Staging()).copy(tensors.values()))
        release()
    else:
        buffers += [tensor_bytes(tensor) for tensor in tensors.values()]
    send_buffers(sock, buffers)


class Staging:
    """A reusable buffer that borrowed tensors are copied into before they are sent (one per connection)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def copy(self, tensors: Iterable[torch.Tensor]) -> memoryview:
        """The tensors' bytes, one after the other, in this buffer (grown when needed)."""
        tensors = list(tensors)
        total = sum(t.numel() * t.element_size() for t in tensors)
        if self._buffer.numel() < total:
            self._buffer = torch.empty(total, dtype=torch.uint8)
        offset = 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes:
                source = (tensor if tensor.is_contiguous() else tensor.contiguous()).reshape(-1).view(torch.uint8)
                self._buffer[offset:offset + nbytes].copy_(source)
            offset += nbytes
        return byte_view(self._buffer)[:total]


class SharedArea:
    """One side's area of a connection's shared segment (``tensorfleet.wire.shm``), as a uint8 tensor.

    A model's messages repeat the same layout every step, so each layout's tensors are made
    once as views of the area (typed, shaped) and reused: one copy call per tensor per message.
    """

    MAX_LAYOUTS = 8

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.nbytes = data.numel()
        self._layouts: dict[tuple[TensorEntry, ...], list[torch.Tensor | None]] = {}
        self._flat: dict[tuple[TensorEntry, ...], tuple[torch.Tensor, dict[str, torch.Tensor]] | None] = {}

    def views(self, entries: tuple[TensorEntry, ...]) -> list[torch.Tensor | None]:
        """Each entry's tensor as a view of the area, in body order; None where its offset is not aligned
        for its dtype (the body has no padding; such a tensor is copied as bytes)."""
        found = self._layouts.get(entries)
        if found is None:
            found, offset = [], 0
            for entry in entries:
                part = self.data[offset:offset + entry.nbytes]
                found.append(part.view(entry.dtype).view(entry.shape) if offset % entry.dtype.itemsize == 0 else None)
                offset += entry.nbytes
            remember(self._layouts, entries, found, self.MAX_LAYOUTS)
        return found

    def flat(self, entries: tuple[TensorEntry, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """A body of one dtype as views of the area, without a copy: the whole body and each tensor; None for
        mixed dtypes.  The views are valid until the message is answered."""
        if entries not in self._flat:
            found, dtype = None, common_dtype(entries)
            if dtype is not None:
                body = self.data[:sum(entry.nbytes for entry in entries)].view(dtype)
                found = body, flat_views(body, entries)
            remember(self._flat, entries, found, self.MAX_LAYOUTS)
        return self._flat[entries]

    def write(self, entries: tuple[TensorEntry, ...], tensors: Iterable[torch.Tensor], start: int = 0) -> None:
        """Copy ``tensors`` into the places of ``entries[start:]`` (a stream writes one at a time)."""
        views = self.views(entries)
        for index, tensor in enumerate(tensors, start):
            view = views[index]
            if view is not None:
                view.copy_(tensor)  # any strides, any device: one pass
            else:
                offset = sum(entry.nbytes for entry in entries[:index])
                self.data[offset:offset + entries[index].nbytes].copy_(_bytes_of(tensor))

    def read(self, entries: tuple[TensorEntry, ...], into: Mapping[str, torch.Tensor] | None,
             allocate: Callable[[TensorEntry], torch.Tensor]) -> dict[str, torch.Tensor]:
        """A body's tensors copied out: each into ``into[name]`` where it fits, else into ``allocate(entry)``
        (the area is the sender's again once the message is answered)."""
        tensors, offset = {}, 0
        for entry, view in zip(entries, self.views(entries)):
            target = (into or {}).get(entry.name)
            if target is None or not entry.matches(target) or not target.is_cpu \
                    or (view is None and not target.is_contiguous()):  # a device's memory: copied by its owner
                target = allocate(entry)
            if view is not None:
                target.copy_(view)
            else:
                _bytes_of(target).copy_(self.data[offset:offset + entry.nbytes])
            tensors[entry.name] = target
            offset += entry.nbytes
        return tensors


def common_dtype(entries: Iterable[TensorEntry]) -> torch.dtype | None:
    """The dtype every entry has; None for no entries or mixed dtypes (a body that is not one flat tensor)."""
    dtypes = {entry.dtype for entry in entries}
    return dtypes.pop() if len(dtypes) == 1 else None


def flat_views(body: torch.Tensor, entries: Iterable[TensorEntry]) -> dict[str, torch.Tensor]:
    """Each entry's tensor as a view of ``body``, a flat tensor of their common dtype, in body order."""
    entries = list(entries)
    parts = body.split([math.prod(entry.shape) for entry in entries])
    return {entry.name: part.view(entry.shape) for entry, part in zip(entries, parts)}


def remember(cache: dict, key: Any, value: Any, limit: int) -> None:
    """``cache[key] = value``, first dropping the oldest entry if ``limit`` are kept."""
    if len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (a view; a copy only if not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as they travel (a contiguous copy only if the tensor is not contiguous)."""
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    return byte_view(tensor if tensor.is_contiguous() else tensor.contiguous())


def send_buffers(sock: socket.socket, buffers: list[memoryview]) -> None:
    """``sendall`` for a list of buffers: as few ``sendmsg`` calls as the kernel allows.

    Each call takes what the socket buffer holds and returns (MSG_DONTWAIT); then we wait
    for room in poll().  A blocking sendmsg of a large body keeps the socket locked while it
    waits for room, and moved 64 MiB about a third slower on loopback.  A TLS socket has no
    sendmsg: ``_send_tls``.
    """
    if isinstance(sock, ssl.SSLSocket):
        _send_tls(sock, buffers)
        return
    pending = [b for b in buffers if len(b)]
    first = 0
    while first < len(pending):
        try:
            sent = sock.sendmsg(pending[first:first + IOV_MAX], [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            _wait_for_room(sock)
            continue
        while sent:
            size = len(pending[first])
            if sent >= size:
                sent -= size
                first += 1
            else:
                pending[first] = pending[first][sent:]
                sent = 0


def _send_tls(sock: ssl.SSLSocket, buffers: list[memoryview]) -> None:
    """``send_buffers`` on a TLS socket: small buffers joined (one record), large ones in pieces of
    ``TLS_SEND_BYTES``, each within the socket's send bound (``set_io_timeouts``)."""
    receive_bound, send_bound = _tls_bounds.get(sock, (sock.gettimeout(),) * 2)
    if send_bound != receive_bound:
        sock.settimeout(send_bound)
    try:
        joined = bytearray()
        for buffer in buffers:
            if len(joined) + len(buffer) <= TLS_JOIN_BYTES:
                joined += buffer
                continue
            if joined:
                sock.sendall(joined)
                joined = bytearray()
            if len(buffer) <= TLS_JOIN_BYTES:
                joined += buffer
                continue
            for start in range(0, len(buffer), TLS_SEND_BYTES):
                sock.sendall(buffer[start:start + TLS_SEND_BYTES])
        if joined:
            sock.sendall(joined)
    finally:
        if send_bound != receive_bound:
            sock.settimeout(receive_bound)


def _wait_for_room(sock: socket.socket) -> None:
    """Sleep until ``sock`` takes more bytes, within its send bound (``set_io_timeouts``; none if unset)."""
    seconds, micros = _TIMEVAL.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _TIMEVAL.size))
    bound_ms = seconds * 1000 + micros / 1000 if seconds or micros else None
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    if not poller.poll(bound_ms):
        raise TimeoutError(f"the peer took no bytes for {bound_ms / 1000:g} s")


_last_reader: "Reader | None" = None  # in this process, the connection that waited for a message last


class Reader:
    """Reads messages from a socket: heads through a small buffer (one ``recv`` for a small message),
    bodies straight into their tensors (``recv_into`` the tensor's memory once the buffered bytes are used)."""

    def __init__(self, sock: socket.socket, *, busy_poll_s: float = 0.0) -> None:
        self._sock = sock
        self.shared_area: SharedArea | None = None  # the peer's area of an attached segment (shm)
        # A TLS socket takes no MSG_DONTWAIT (and its bytes may wait decrypted in OpenSSL, unseen by the
        # kernel): it never polls.
        self._busy_poll_s = 0.0 if isinstance(sock, ssl.SSLSocket) else busy_poll_s
        self._buffer = bytearray(READ_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0  # unread bytes are _buffer[_start:_end]

    def _fill(self) -> int:
        """Read more into the buffer (compacting it first); return how many bytes came, 0 at end of stream."""
        if self._start:
            # bytes(): the source and destination overlap, and a slice assignment may memcpy
            self._buffer[:self._end - self._start] = bytes(self._view[self._start:self._end])
            self._start, self._end = 0, self._end - self._start
        target = self._view[self._end:]
        count = self._busy_poll(target) if self._busy_poll_s else None
        if count is None:
            count = self._sock.recv_into(target)
        self._end += count
        return count

    def _busy_poll(self, target: memoryview) -> int | None:
        """Ask for bytes without sleeping, for up to ``busy_poll_s``; None if none came (then block).

        A thread that sleeps in recv() is woken by the kernel when bytes arrive, and on a
        virtual machine an idle vCPU is halted: the wake-up and the cold caches after it cost
        a few hundred microseconds per message, more than the work of a small model's step.
        Polling keeps the core awake, so it only pays where every task has a core of its own
        (``tensorfleet launch`` turns it on only then).  Only the connection that last waited
        polls; when two alternate (several workers on one ps) neither does.
        """
        global _last_reader
        if _last_reader is not self:
            _last_reader = self
            return None
        deadline = time.perf_counter() + self._busy_poll_s
        while True:
            try:
                return self._sock.recv_into(target, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() > deadline:
                    return None

    def _read_small(self, size: int) -> bytes:
        """``size`` bytes (less only at end of stream) through the buffer; ``size`` may exceed it (a header)."""
        if size > len(self._buffer):
            out = bytearray(size)
            got = self._take_buffered(memoryview(out))
            return bytes(out[:got + self._recv_direct(memoryview(out)[got:])])
        while self._end - self._start < size and self._fill():
            pass
        size = min(size, self._end - self._start)
        data = bytes(self._view[self._start:self._start + size])
        self._start += size
        return data

    def _take_buffered(self, target: memoryview) -> int:
        count = min(len(target), self._end - self._start)
        target[:count] = self._view[self._start:self._start + count]
        self._start += count
        return count

    def _recv_direct(self, target: memoryview) -> int:
        got = 0
        while got < len(target):
            count = self._sock.recv_into(target[got:])
            if not count:
                break
            got += count
        return got

    def read_head(self, *, max_body_bytes: int, max_header_bytes: int = MAX_HEADER_BYTES) -> Head | None:
        """The next message's head, or None if the peer closed the stream cleanly before it.

        Raises:
            WireError: the prefix or header is malformed or over a limit (the stream is then unusable).
            UnavailableError: the stream ended in the middle of the head.
        """
        prefix = self._read_small(PREFIX.size)
        if not prefix:
            return None
        if len(prefix) < PREFIX.size:
            raise UnavailableError(f"the stream ended after {len(prefix)} bytes of a message prefix")
        magic, version, flags, header_bytes, body_bytes = PREFIX.unpack(prefix)
        if magic != MAGIC:
            if magic[:2] == b"\x16\x03":  # a TLS record of handshake: ClientHello
                raise WireError("a TLS handshake on a plaintext data port: the client has TLS certificates "
                                "(TENSORFLEET_TLS_*), this task has none")
            raise WireError(f"bad magic {magic!r}: not a tensorfleet data-plane message")
        if prefix[6:8] != b"\0\0":  # reserved for a later version: zero today, so that one can tell
            raise WireError(f"reserved prefix bytes are {prefix[6:8].hex()}, not zero")
        if version != VERSION:
            raise WireError(f"data-plane version {version} is not supported (this build speaks {VERSION})")
        if flags & ~SHARED:
            raise WireError(f"unknown message flags {flags:#04x}")
        if header_bytes > max_header_bytes:
            raise WireError(f"header of {header_bytes} bytes exceeds the limit of {max_header_bytes}")
        if body_bytes > max_body_bytes:
            raise WireError(f"message body of {body_bytes} bytes exceeds the limit of {max_body_bytes} bytes")
        shared = bool(flags & SHARED)
        if shared and (self.shared_area is None or body_bytes > self.shared_area.nbytes):
            raise WireError(f"a message puts its body of {body_bytes} bytes in shared memory, but this connection "
                            f"has {'no segment attached' if self.shared_area is None else 'a smaller one'}")
        raw = self._read_small(header_bytes)
        if len(raw) < header_bytes:
            raise UnavailableError("the stream ended in the middle of a message header")
        head = _parse_header(raw, body_bytes)
        return Head(head.kind, head.meta, head.entries, body_bytes, shared=True) if shared else head

    def read_into(self, tensor: torch.Tensor) -> None:
        """Fill a contiguous CPU tensor with the next ``tensor.nbytes`` bytes of the stream."""
        view = byte_view(tensor)
        got = self._take_buffered(view)
        if got < len(view) and len(view) - got < len(self._buffer) // 2:
            while self._end - self._start < len(view) - got and self._fill():  # small: one recv, then copy
                pass
            got += self._take_buffered(view[got:])
        got += self._recv_direct(view[got:])
        if got < len(view):
            raise UnavailableError(f"the stream ended {len(view) - got} bytes short of a tensor")

    def skip(self, nbytes: int) -> None:
        """Read and discard ``nbytes`` (the body of a refused message), in bounded pieces."""
        nbytes -= self._take_buffered(memoryview(bytearray(min(nbytes, self._end - self._start))))
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes:
            count = self._sock.recv_into(scratch[:min(nbytes, len(scratch))])
            if not count:
                raise UnavailableError("the stream ended inside a message body being skipped")
            nbytes -= count

    def close(self) -> None:
        """Nothing to release: the socket belongs to the caller."""


def _parse_header(raw: bytes, body_bytes: int) -> Head:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, huge ints; deep nesting
        raise WireError(f"header is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str) \
            or not isinstance(header.get("meta"), dict) or not isinstance(header.get("tensors"), list):
        raise WireError("header must be an object with 'kind' (string), 'meta' (object) and 'tensors' (list)")
    entries = [check_entry(entry) for entry in header["tensors"]]
    names = [entry.name for entry in entries]
    if len(set(names)) != len(names):
        raise WireError("a tensor name appears twice in one message")
    declared = sum(entry.nbytes for entry in entries)
    if declared != body_bytes:
        raise WireError(f"the header's tensors take {declared} bytes but the prefix announces {body_bytes}")
    return Head(header["kind"], header["meta"], entries, body_bytes)


def set_io_timeouts(sock: socket.socket, *, receive: float | None, send: float | None) -> None:
    """Bound each receive and each send on ``sock`` to that many seconds without progress (None: unbounded).

    The kernel keeps the bound (SO_RCVTIMEO, SO_SNDTIMEO) and the socket stays in blocking mode:
    Python's own ``settimeout`` costs an ioctl to set and a poll() before every call, on every
    message of every step.  A receive that times out raises BlockingIOError (EAGAIN); a send
    (``send_buffers``, which waits for room in poll() within SO_SNDTIMEO) raises TimeoutError.

    A TLS socket gets Python's timeout instead: in blocking mode Python's ssl retries a read that
    SO_RCVTIMEO cut short (OpenSSL's WANT_READ) forever, so the kernel's bound would never end it.
    Its receives then raise TimeoutError past ``receive``; ``_send_tls`` switches to ``send`` while
    it sends.
    """
    tls = isinstance(sock, ssl.SSLSocket)
    sock.settimeout(receive if tls else None)
    if tls:
        _tls_bounds[sock] = (receive, send)
    for option, seconds in ((socket.SO_RCVTIMEO, receive), (socket.SO_SNDTIMEO, send)):
        micros = 0 if seconds is None or tls else max(1, round(seconds * 1e6))  # 0 means no bound to the kernel
        sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(micros // 1_000_000, micros % 1_000_000))


# A TLS socket's (receive, send) bounds: its own timeout is the receive bound, and sends switch to theirs.
_tls_bounds: "weakref.WeakKeyDictionary[ssl.SSLSocket, tuple[float | None, float | None]]" = \
    weakref.WeakKeyDictionary()


_TIMEVAL = struct.Struct("@ll")  # struct timeval {time_t tv_sec; suseconds_t tv_usec}


# After a partition heals, a connection resumes only at its next retransmission, and TCP doubles the wait
# each time up to 120 s: a 120 s cut then stalled a sync job ~94 s more. Capped at 1 s (Linux >= 6.15),
# the connection resumes within a second; the user timeout keeps the kernel from giving it up sooner than
# it would have with the uncapped backoff (~15 min).
_TCP_RTO_MAX_MS = getattr(socket, "TCP_RTO_MAX_MS", 44)
RETRANSMIT_MAX_MS = 1000
USER_TIMEOUT_MS = 900_000


def configure(sock: socket.socket) -> socket.socket:
    """Small messages leave at once (no Nagle delay): a step is a few small round trips. Where the kernel
    allows, lost packets are sent again at least every second (``RETRANSMIT_MAX_MS``)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sys.platform == "linux":
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_RTO_MAX_MS, RETRANSMIT_MAX_MS)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
        except OSError:  # an older kernel (ENOPROTOOPT): TCP's own backoff, as before
            pass
    return sock

