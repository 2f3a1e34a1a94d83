"""The data plane: pull and push over TCP (TLS when the job has certificates), beside each task's gRPC port.

gRPC Python moves a 64 MiB unary message at a fraction of what the loopback link
allows, and costs ~1 ms per call; the two calls of every training step (pull,
push) are what makes training fast or slow.  So they travel here instead, like
ps-lite's "van": one TCP connection per worker and shard, messages framed by
``frame`` (no pickle, size limits, validated before use), tensor bytes sent from
and received into tensors in place.  gRPC keeps the control plane (Init,
Snapshot, Status, Done), and the ps's Status tells workers its data port; the chief
fetches snapshots (checkpoints' rows, tens of MB to a page of 256 MiB) here too.

This module is what both ends share: the message kinds, what a method is given
(``Request``, its body received into per-connection buffers) and answers (``Reply``),
and ``read_tensors``.  The server is ``tensorfleet.wire.dataserver`` (``DataServer``),
the client ``tensorfleet.wire.datachannel`` (``DataChannel``, ``Stream``).

With a job token (``tensorfleet.wire.auth``) a connection must open with ``Hello``
carrying it; without it, the task answers UNAUTHENTICATED and closes the connection
before reading anything else.

Between tasks on one host the bodies go through shared memory (``tensorfleet.wire.shm``):
a client whose bodies reach ``SHARED_MIN_BYTES`` (``datachannel``) attaches a segment to its connection
(``Attach``), sized to the largest request it sends and the largest reply it has seen;
bodies that fit go there, heads stay on the socket.  A task that cannot map the segment
(another host, another user, shared memory off) refuses, and the connection stays on TCP.

With TLS (``WireOptions.tls``, the same certificates as gRPC) every connection is wrapped:
the server presents the task's certificate, the client checks it against the fleet's CA
and the host it dialled, and every byte on the stream is encrypted and authenticated; the
token's challenge and response (``Hello``) then runs inside it.  A plaintext client of a TLS task is
answered UNAVAILABLE naming TLS; a TLS client of a plaintext task fails its handshake with
UNAVAILABLE naming TLS.  Shared memory stays on for TLS connections between tasks on one
host: those bodies never cross a network (the segment is the same user's, see ``shm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from tensorfleet.wire import frame
from tensorfleet.wire.codec import TensorEntry

OK = "OK"
HELLO = "Hello"  # the first message of a connection when the job has a token: the client's nonce
PROVE = "Prove"  # the second: the client's proof, after the server answered the Hello with its nonce and proof
ATTACH = "Attach"  # a client's shared segment for this connection's bodies (see tensorfleet.wire.shm)


@dataclass
class Reply:
    """What a method answers. ``release`` runs once the reply is sent (a read lock held over live tensors)."""

    meta: dict[str, Any]
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    release: Callable[[], None] | None = None


class BufferPool:
    """Per-connection receive buffers, reused request after request (no allocation in the steady state).

    A body whose tensors share one dtype lands in one flat buffer (``body``), the tensors being
    views of it: one receive for the whole body, and one pass can check all of it (NaN/Inf).
    """

    MAX_LAYOUTS = 4  # flat buffers kept per connection (a client pushing subsets varies its layout)

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._layouts: dict[tuple[TensorEntry, ...], tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def get(self, entry: TensorEntry) -> torch.Tensor:
        buffer = self._buffers.get(entry.name)
        if buffer is None or not entry.matches(buffer):
            buffer = self._buffers[entry.name] = torch.empty(entry.shape, dtype=entry.dtype)
        return buffer

    def flat(self, entries: list[TensorEntry]) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """One buffer for a whole body of one dtype, and each tensor as a view of it; None for mixed dtypes."""
        key = tuple(entries)
        found = self._layouts.get(key)
        if found is None:
            dtype = frame.common_dtype(entries)
            if dtype is None:
                return None
            body = torch.empty(sum(math.prod(entry.shape) for entry in entries), dtype=dtype)
            found = (body, frame.flat_views(body, entries))
            frame.remember(self._layouts, key, found, self.MAX_LAYOUTS)
        return found


class Request:
    """One request being served: its meta and tensor entries; ``receive`` reads its body."""

    def __init__(self, head: frame.Head, reader: frame.Reader, pool: BufferPool) -> None:
        self.meta, self.entries = head.meta, head.entries
        self.body: torch.Tensor | None = None  # after receive(): the whole body as one tensor, when it is one
        self._reader, self._pool = reader, pool
        self._shared = head.shared
        self._body_left = 0 if head.shared else head.body_bytes  # bytes of body still on the stream

    def receive(self, into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Read the body: each tensor into ``into[name]`` if given (same shape and dtype), else a pooled buffer.

        Without ``into``, tensors are only valid until the reply is sent (pooled buffers are reused).
        A body in shared memory is copied out first, never handed on as views of the segment: the client
        can write there at any time, so what the server checks (ids in range, finite gradients) must be
        the bytes it then uses.
        """
        if self._shared:
            area, layout = self._reader.shared_area, tuple(self.entries)
            found = area.flat(layout) if into is None else None
            flat = self._pool.flat(self.entries) if found is not None else None
            if flat is not None:
                self.body, tensors = flat
                self.body.copy_(found[0])  # one copy of the whole body, out of the client's reach
                return tensors
            return area.read(layout, into, self._pool.get)
        flat = self._pool.flat(self.entries) if into is None else None
        if flat is not None:
            self.body, tensors = flat
            self._reader.read_into(self.body)
        else:
            tensors = read_tensors(self._reader, self.entries, into, self._pool.get)
        self._body_left = 0
        return tensors

    def skip_body(self) -> None:
        if self._body_left:
            self._reader.skip(self._body_left)
            self._body_left = 0


Method = Callable[[Request], Reply]


def read_tensors(reader: frame.Reader, entries: list[TensorEntry], into: Mapping[str, torch.Tensor] | None,
                 allocate: Callable[[TensorEntry], torch.Tensor]) -> dict[str, torch.Tensor]:
    """A body's tensors, each received into ``into[name]`` where it fits (shape, dtype, contiguous, in host
    memory: a socket cannot write a device's), else into ``allocate(entry)``."""
    tensors = {}
    for entry in entries:
        target = (into or {}).get(entry.name)
        if target is None or not entry.matches(target) or not target.is_contiguous() or not target.is_cpu:
            target = allocate(entry)
        reader.read_into(target)
        tensors[entry.name] = target
    return tensors
