"""The data plane: pull and push over TCP (TLS when the job has certificates), beside each task's gRPC port.

gRPC Python moves a 64 MiB unary message at a fraction of what the loopback link
allows, and costs ~1 ms per call; the two calls of every training step (pull,
push) are what makes training fast or slow.  So they travel here instead, like
ps-lite's "van": one TCP connection per worker and shard, messages framed by
``frame`` (no pickle, size limits, validated before use), tensor bytes sent from
and received into tensors in place.  gRPC keeps the control plane (Init,
Snapshot, Status, Done), and the ps's Status tells workers its data port; the chief
fetches snapshots (checkpoints' rows, tens of MB to a page of 256 MiB) here too.

Server: one thread per connection reads a request head, lets the method choose
where the body goes (``Request.receive``; a method that refuses the request
before that has its body skipped, so the connection stays usable), and sends the
``Reply``.  Errors travel as status codes (``TensorfleetError.code``); a
malformed stream gets an error reply and the connection is closed.  A bug in a
method becomes an INTERNAL reply, never a dead server.

With a job token (``tensorfleet.wire.auth``) a connection must open with ``Hello``
carrying it; without it, the task answers UNAUTHENTICATED and closes the connection
before reading anything else.

Client: ``DataChannel`` is one connection, one request at a time, connected on
first use and again after a failure; a broken connection is UNAVAILABLE
(recoverable: the ps may be restarting), silence past the deadline is
DEADLINE_EXCEEDED.  ``Stream`` sends one request whose tensors are handed over
one by one as they become ready (gradients during backward).

Between tasks on one host the bodies go through shared memory (``tensorfleet.wire.shm``):
a client whose bodies reach ``SHARED_MIN_BYTES`` attaches a segment to its connection
(``Attach``), sized to the largest request it sends and the largest reply it has seen;
bodies that fit go there, heads stay on the socket.  A task that cannot map the segment
(another host, another user, shared memory off) refuses, and the connection stays on TCP.

With TLS (``WireOptions.tls``, the same certificates as gRPC) every connection is wrapped:
the server presents the task's certificate, the client checks it against the fleet's CA
and the host it dialled, and every byte on the stream is encrypted and authenticated; the
token's challenge and response (``Hello``) then runs inside it.  The handshake happens on the
connection's own thread, within the same ``HELLO_TIMEOUT_S`` as the Hello (a stranger holds
neither the accepting thread nor a thread for longer).  A plaintext client of a TLS task is
answered UNAVAILABLE naming TLS; a TLS client of a plaintext task fails its handshake with
UNAVAILABLE naming TLS.  Shared memory stays on for TLS connections between tasks on one
host: those bodies never cross a network (the segment is the same user's, see ``shm``).
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import logging
import math
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from tensorfleet import errors
from tensorfleet.wire import auth, frame, shm
from tensorfleet.wire.codec import TensorEntry
from tensorfleet.wire.rpc import SHARED_MEMORY_ENV, WireOptions

log = logging.getLogger(__name__)

OK = "OK"
HELLO = "Hello"  # the first message of a connection when the job has a token: the client's nonce
PROVE = "Prove"  # the second: the client's proof, after the server answered the Hello with its nonce and proof
ATTACH = "Attach"  # a client's shared segment for this connection's bodies (see tensorfleet.wire.shm)
# Smaller bodies stay on the socket: a segment costs a round trip and its pages to set up, and at
# 4 KiB the two paths move bytes alike (benchmarks/wire_throughput.py); at 64 KiB the segment wins.
SHARED_MIN_BYTES = 64 * 1024
# What a stranger can make a task spend before it has shown the token (Hello): a bounded number of
# connections, a small head, and a bounded time in all (not per recv: a byte a minute must not hold
# a thread forever).
MAX_CONNECTIONS = 512  # connections a data server serves at once; more are closed at once
MAX_UNAUTHENTICATED = 32  # of those, connections that have not said Hello yet
HELLO_HEADER_BYTES = 4096  # a Hello's head is a token: a few hundred bytes
HELLO_TIMEOUT_S = 10.0  # from accept to a complete Hello (the TLS handshake included)
IDLE_TIMEOUT_S = 900.0  # an authenticated connection silent this long is closed (the client reconnects)
_ACCEPT_BACKOFF_S = (0.05, 1.0)  # out of descriptors or memory: wait, then accept again
_RESOURCE_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


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
    """A body's tensors, each received into ``into[name]`` where it fits (shape, dtype, contiguous), else
    into ``allocate(entry)``."""
    tensors = {}
    for entry in entries:
        target = (into or {}).get(entry.name)
        if target is None or not entry.matches(target) or not target.is_contiguous():
            target = allocate(entry)
        reader.read_into(target)
        tensors[entry.name] = target
    return tensors


class DataServer:
    """Serves ``methods`` on ``host`` (port 0: any free port) until ``stop()``.

    Args:
        host: the address to bind, the task's host from the cluster spec.
        methods: method name -> function of a ``Request`` returning a ``Reply``.
        task: this task's full name (``/job:ps/task:0``): for messages, and what the Hello's proofs are bound to.
        options: message size limit.
    """

    def __init__(self, host: str, methods: Mapping[str, Method], *, task: str,
                 options: WireOptions | None = None, port: int = 0, gate: auth.Gate | None = None) -> None:
        options = options or WireOptions()  # from the environment now, not when the module loaded
        self.methods, self.task, self.options = dict(methods), task, options
        self.gate = (gate if gate is not None else auth.Gate(options.token, task)).check_guards(task)
        try:
            self._listener = socket.create_server((host, port), backlog=128)
        except OSError as exc:
            raise errors.UnavailableError(f"cannot listen for data on {host}:{port}: {exc}", task=task) from None
        self.host, self.port = host, self._listener.getsockname()[1]
        try:  # the files are read now: a task with unreadable certificates does not start
            self._tls = options.tls.server_context() if options.tls is not None else None
        except BaseException:
            self._listener.close()
            raise
        self._connections: set[socket.socket] = set()  # a connection's TLS socket once wrapped
        self._unauthenticated = 0  # connections that still owe their Hello
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopped = False
        self.refused_connections = 0  # closed at once: over a cap, or while out of descriptors
        self._last_warning = 0.0
        self._accepter = threading.Thread(target=self._accept_loop, name=f"data-accept-{task}", daemon=True)
        self._accepter.start()

    def _accept_loop(self) -> None:
        backoff = _ACCEPT_BACKOFF_S[0]
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._stopped or exc.errno not in _RESOURCE_ERRORS:
                    return  # the listener was closed: stop()
                # Out of file descriptors or memory (a flood of connections, say): the port must not die.
                self._warn(f"cannot accept a data connection ({exc.strerror}); trying again in {backoff:g} s")
                time.sleep(backoff)
                backoff = min(backoff * 2, _ACCEPT_BACKOFF_S[1])
                continue
            backoff = _ACCEPT_BACKOFF_S[0]
            with self._lock:
                if self._stopped:
                    sock.close()
                    return
                full = len(self._connections) >= MAX_CONNECTIONS or (
                    self.gate.required and self._unauthenticated >= MAX_UNAUTHENTICATED)
                if not full:
                    self._connections.add(sock)
                    self._unauthenticated += self.gate.required
            if full:
                self.refused_connections += 1
                sock.close()
                self._warn(f"closed a data connection at once: {MAX_CONNECTIONS} connections or "
                           f"{MAX_UNAUTHENTICATED} without their Hello are open already "
                           f"({self.refused_connections} closed so far)")
                continue
            with self._lock:
                thread = threading.Thread(target=self._serve, args=(frame.configure(sock),), daemon=True,
                                          name=f"data-{self.task}")
                # A thread stays here until it has ended, its locals freed included (join() waits for that).
                self._threads = {t for t in self._threads if t.is_alive()} | {thread}
            try:
                thread.start()
            except RuntimeError as exc:  # out of threads: this connection goes, the port stays
                with self._lock:
                    self._connections.discard(sock)
                    self._unauthenticated -= self.gate.required
                    self._threads.discard(thread)
                sock.close()
                self._warn(f"cannot start a thread for a data connection ({exc}); closed it")

    def _warn(self, message: str) -> None:
        """A warning at most every 10 s: a flood must not flood the log too."""
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            log.warning("%s: %s", self.task, message)

    def _serve(self, sock: socket.socket) -> None:
        conn = sock  # the connection as _connections holds it: its TLS socket once wrapped
        reader: frame.Reader | None = None
        owes_hello = self.gate.required
        # The opening (TLS handshake, Hello) has HELLO_TIMEOUT_S in all, from accept: a timer shuts the socket
        # then (each recv's own timeout alone would let a byte a minute through).
        opening = _Opening(sock, HELLO_TIMEOUT_S) if owes_hello or self._tls is not None else None
        try:
            if opening is not None:
                frame.set_io_timeouts(sock, receive=HELLO_TIMEOUT_S, send=HELLO_TIMEOUT_S)
            if self._tls is not None:
                wrapped = self._wrap(sock, opening)
                if wrapped is None:
                    return
                conn = wrapped
                try:
                    conn.do_handshake()  # bounded as a whole by the socket's timeout, and by the opening's timer
                except ssl.SSLError as exc:
                    self._warn(f"refused a data connection whose TLS handshake failed: {exc.reason or exc} (a "
                               "client without TLS, or without the fleet's CA?)")
                    return
            reader = frame.Reader(conn, busy_poll_s=self.options.busy_poll_us * 1e-6)
            admitted = True
            if owes_hello:
                admitted = self._hello(conn, reader, opening)
                with self._lock:
                    self._unauthenticated -= 1
                owes_hello = False
            elif opening is not None:
                opening.cancel()
            # Waiting for the next request is bounded by the idle timeout (the client reconnects); a reply by
            # the deadline: a client that stops reading must not hold the ps's live tensors forever.
            frame.set_io_timeouts(conn, receive=IDLE_TIMEOUT_S, send=self.options.deadline_s)
            link = _Link(conn, reader)
            while admitted and self._serve_one(link):
                pass
        except (OSError, errors.UnavailableError):
            pass  # the peer went away mid-message (nothing was applied), or was idle too long: closed
        except Exception:  # a bug must not leave a half-read stream open: say so, close this connection only
            log.exception("%s: unexpected error on a data connection; closing it", self.task)
        finally:
            if opening is not None:
                opening.cancel()
            if reader is not None:
                reader.close()
            conn.close()
            with self._lock:
                self._connections.discard(conn)
                self._unauthenticated -= owes_hello

    def _wrap(self, sock: socket.socket, opening: "_Opening") -> ssl.SSLSocket | None:
        """The accepted connection wrapped in TLS, its handshake still to come (on this thread); None if it is
        over already: closed before a byte, or a client without TLS (answered why)."""
        first = sock.recv(1, socket.MSG_PEEK)  # within the opening: SO_RCVTIMEO, and the timer
        if not first:
            return None  # closed before saying anything (a port probe)
        if first == frame.MAGIC[:1]:  # a tensorfleet message in clear: a client without TLS
            self._refuse_plaintext(sock)
            return None
        conn = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        with self._lock:  # the same descriptor in a new socket object: close() must find this one
            self._connections.discard(sock)
            self._connections.add(conn)
            stopped = self._stopped
        opening.follow(conn)
        if stopped:
            _shut(conn)
        frame.set_io_timeouts(conn, receive=HELLO_TIMEOUT_S, send=HELLO_TIMEOUT_S)
        return conn

    def _refuse_plaintext(self, sock: socket.socket) -> None:
        """Answer a client that speaks without TLS, in its own terms: UNAVAILABLE, naming the setting."""
        self._warn("refused a data connection without TLS: this task's data plane requires it")
        try:
            # Its first head is read (bounded like a Hello), so that closing does not reset the reply away.
            frame.Reader(sock).read_head(max_body_bytes=self.options.max_message_bytes,
                                         max_header_bytes=HELLO_HEADER_BYTES)
        except errors.WireError:
            pass
        frame.send_message(sock, errors.UnavailableError.code, {
            "message": f"{self.task} serves data over TLS only, and this client connected without it: set "
                       "TENSORFLEET_TLS_CERT, TENSORFLEET_TLS_KEY and TENSORFLEET_TLS_CA for every task"})

    def _hello(self, sock: socket.socket, reader: frame.Reader, opening: "_Opening") -> bool:
        """A connection must open with ``Hello`` carrying the job's token; anything else is refused and closed.

        A silent or dripping peer must not hold a thread: ``opening`` ends it at HELLO_TIMEOUT_S from accept,
        and its head is small.
        """
        try:  # no body is ever read before the Hello: only its announced size is checked against the limit
            head = reader.read_head(max_body_bytes=self.options.max_message_bytes, max_header_bytes=HELLO_HEADER_BYTES)
            if head is None:
                return False  # closed before saying anything (a port probe): nothing to refuse
            proven = False
            client_nonce = head.meta.get("nonce")
            if head.kind == HELLO and not head.body_bytes and auth.is_nonce(client_nonce):
                # The challenge: our nonce and our proof (the client checks we hold the token too), then its proof.
                server_nonce = auth.new_nonce()
                frame.send_message(sock, OK, {"nonce": server_nonce,
                                              "proof": self.gate.proof("server", client_nonce, server_nonce)})
                head = reader.read_head(max_body_bytes=self.options.max_message_bytes,
                                        max_header_bytes=HELLO_HEADER_BYTES)
                if head is None:  # it left without its proof: our proof failed its check (or it had none)
                    self.gate.refuse()
                    return False
                proven = head.kind == PROVE and not head.body_bytes and self.gate.admits_proof(
                    head.meta.get("proof"), "client", server_nonce, client_nonce)
            else:
                self.gate.admits(None)  # not a Hello: counted as a refusal
        except errors.WireError:
            self.gate.admits(None)  # a head too large or malformed: refused like anything but the Hello
            proven = False
        finally:
            opening.cancel()
        if proven:
            frame.send_message(sock, OK, {})
            return True
        self._warn(f"refused a data connection without the job's token ({self.gate.refused} refused so far)")
        frame.send_message(sock, errors.UnauthenticatedError.code, {
            "message": f"{self.task} refuses data connections without the job's token: set TENSORFLEET_TOKEN "
                       "(or TENSORFLEET_TOKEN_FILE) to the token of this job"})
        return False

    def _serve_one(self, link: "_Link") -> bool:
        """Serve one request; False when the connection is over (closed, or its stream can't be trusted)."""
        sock = link.sock
        try:
            head = link.reader.read_head(max_body_bytes=self.options.max_message_bytes)
        except errors.WireError as exc:
            frame.send_message(sock, exc.code, {"message": exc.message})
            return False  # framing is lost: close rather than guess where the next message starts
        if head is None:
            return False
        request = Request(head, link.reader, link.pool)
        try:
            if head.kind == ATTACH:
                request.skip_body()
                link.attach(self._attach(head))
                frame.send_message(sock, OK, {})
                return True
            method = self.methods.get(head.kind)
            if method is None:
                raise errors.InvalidArgumentError(f"unknown data-plane method {head.kind!r}: "
                                                  f"this task serves {', '.join(sorted(self.methods))}")
            reply = method(request)
        except errors.TensorfleetError as exc:
            request.skip_body()
            frame.send_message(sock, exc.code, {"message": exc.message})
            return True
        except Exception as exc:  # a bug must not take the server down: report it, keep serving
            log.exception("%s: unexpected error serving %s", self.task, head.kind)
            request.skip_body()
            frame.send_message(sock, "INTERNAL", {"message": f"{type(exc).__name__}: {exc}"})
            return True
        released = False

        def release() -> None:  # once: by send_message before it sends, or below if it failed first
            nonlocal released
            if not released and reply.release is not None:
                released = True
                reply.release()

        try:
            request.skip_body()  # a method that ignored the tensors still leaves the stream in step
            frame.send_message(sock, OK, reply.meta, reply.tensors, area=link.reply_area,
                               release=release if reply.release is not None else None, staging=link.staging)
        finally:
            release()
        return True

    def _attach(self, head: frame.Head) -> shm.Segment:
        """Map the client's segment for this connection's bodies, or say why not (it stays on TCP)."""
        if not self.options.shared_memory:
            raise errors.InvalidArgumentError(f"{self.task} does not use shared memory "
                                              f"({SHARED_MEMORY_ENV}=0): stay on TCP")
        if head.entries:
            raise errors.InvalidArgumentError("an Attach carries no tensors")
        meta = head.meta
        return shm.Segment.attach(meta.get("path"), meta.get("nonce"), meta.get("request_bytes"),
                                  meta.get("reply_bytes"), max_area_bytes=self.options.max_message_bytes)

    def stop(self, timeout_s: float = 5.0) -> None:
        """``close()``, then ``join(timeout_s)``."""
        self.close()
        self.join(timeout_s)

    def close(self) -> None:
        """Close the listener and every connection; serving threads end on their next read."""
        with self._lock:
            self._stopped = True
            connections = list(self._connections)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept(); close() alone does not
        except OSError:
            pass
        self._listener.close()
        for sock in connections:
            _shut(sock)

    def join(self, timeout_s: float) -> None:
        """Wait, up to ``timeout_s`` in all, for the accepting and serving threads to end (after ``close``).

        Waiting matters at exit: a daemon thread still freeing its buffers while the interpreter
        finalizes is killed inside torch's tensor deallocation, which aborts the process (SIGABRT).
        A thread inside a method (a sync push waiting for its step) ends only when that returns.
        """
        with self._lock:
            threads = [self._accepter, *self._threads]
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0.0))


class _Link:
    """The server's side of one connection: its socket, reader, receive buffers and shared segment."""

    def __init__(self, sock: socket.socket, reader: frame.Reader) -> None:
        self.sock, self.reader, self.pool = sock, reader, BufferPool()
        self.reply_area: frame.SharedArea | None = None
        self.staging = frame.Staging()  # replies of borrowed tensors are copied here before they are sent

    def attach(self, segment: shm.Segment) -> None:
        """Bodies from now on may be in ``segment`` (a previous one is unmapped once unused)."""
        self.reader.shared_area = frame.SharedArea(segment.request)
        self.reply_area = frame.SharedArea(segment.reply)


class DataChannel:
    """The client side: one connection to one task's data port, one request at a time.

    Example:
        >>> channel = DataChannel(task="/job:ps/task:0")                    # doctest: +SKIP
        >>> channel.set_address("127.0.0.1", 40123)                          # doctest: +SKIP
        >>> meta, values = channel.call("Pull", into=params)                 # doctest: +SKIP
    """

    def __init__(self, *, task: str, options: WireOptions | None = None) -> None:
        self.task, self.options = task, options or WireOptions()  # from the environment now, not at import
        self.address: tuple[str, int] | None = None
        self._sock: socket.socket | None = None
        self._sock_address: tuple[str, int] | None = None  # where _sock leads
        self._reader: frame.Reader | None = None
        self._io_timeout: float | None = None  # the kernel's bound on _sock's sends and receives
        self._segment: shm.Segment | None = None  # this connection's shared segment, once attached
        self._request_area: frame.SharedArea | None = None  # its request area
        self._tcp_only = False  # the task could not use a segment of ours (another host, shared memory off)
        self._largest_reply = 0  # bytes of the largest reply body seen: the reply area to ask for
        # With TLS: the fleet's CA, read now (a client with unreadable files fails at once, not at its first call)
        self._tls = self.options.tls.client_context() if self.options.tls is not None else None
        self._lock = threading.Lock()

    def set_address(self, host: str, port: int) -> None:
        """Where the task's data port is (from its Status); the next call connects there.

        Never waits for a call in flight: in sync mode that call may be waiting for a step that
        only completes once the caller has recovered (waiting for it here would deadlock).
        """
        self.address = (host, port)  # one assignment: atomic; _connected() compares it with _sock_address

    def call(self, method: str, meta: Mapping[str, Any] | None = None,
             tensors: Mapping[str, torch.Tensor] | None = None, *,
             into: Mapping[str, torch.Tensor] | None = None,
             timeout: float | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """One request and its reply; reply tensors land in ``into[name]`` where shape and dtype match.

        Raises:
            UnavailableError: the task cannot be reached or the connection broke (recoverable).
            DeadlineExceededError: no progress for ``timeout`` seconds (default: the options' deadline).
            TensorfleetError: the error the task answered with, as its own class.
        """
        with self._lock:
            try:
                sock = self._connected(timeout)
                nbytes = sum(t.numel() * t.element_size() for t in tensors.values()) if tensors else 0
                frame.send_message(sock, method, meta, tensors, area=self._shared_area(nbytes))
                reply = self._read_reply(into)
            except BaseException as exc:
                self._connection_failed(exc, timeout)
                raise
        return reply.result(self.task)

    def call_in_two(self, method: str, meta: Mapping[str, Any] | None = None, *, timeout: float | None = None
                    ) -> tuple[dict[str, Any], Callable[..., dict[str, torch.Tensor]]]:
        """A request without tensors whose reply is read in two parts: return the reply's meta as soon as its
        head arrives, and a function that reads its tensors (from any thread; call it once; ``drop=True``
        closes the connection instead of reading them). The connection is this call's until then. A
        Snapshot's head leaves the ps once its state is taken: the chief goes on training while the rows
        travel.

        Raises: as ``call``, for the head; the function raises as ``call`` for the body.
        """
        self._lock.acquire()
        try:
            try:
                sock = self._connected(timeout)
                frame.send_message(sock, method, meta, None, area=self._shared_area(0))
                head = self._read_head()
                refused = None if head.kind == OK else _Reply(head.kind, head.meta, self._read_body(head, None))
            except BaseException as exc:
                self._connection_failed(exc, timeout)
                raise
            if refused is not None:
                refused.result(self.task)  # raises the task's error
        except BaseException:
            self._lock.release()
            raise
        read: list[bool] = []

        def body(*, drop: bool = False) -> dict[str, torch.Tensor]:
            if read:
                raise RuntimeError(f"the body of {method} was read already")
            read.append(True)
            try:
                if drop:
                    self._close()  # the task sees the connection go; nothing is read
                    return {}
                try:
                    return self._read_body(head, None)
                except BaseException as exc:
                    self._connection_failed(exc, timeout)
                    raise
            finally:
                self._lock.release()

        return head.meta, body

    @property
    def shared(self) -> bool:
        """Whether bodies on this connection go through shared memory (a task on this host)."""
        return self._segment is not None

    def stream(self, method: str, meta: Mapping[str, Any], entries: list[TensorEntry], *,
               timeout: float | None = None) -> "Stream":
        """Start a request whose tensors (``entries``, in order) will be sent as they become ready.

        The channel stays locked until the stream ends (``stream_end``, through the Stream's
        ``finish`` or ``abort``): no other request can come between its parts.
        """
        self._lock.acquire()
        try:
            try:
                sock, nbytes = self._connected(timeout), frame.body_size(entries)
                area = self._shared_area(nbytes) if nbytes else None
                if area is not None:  # the body goes in place first, its head last
                    return Stream(self, entries, timeout, shared=(area, method, meta))
                frame.send_buffers(sock, [memoryview(frame.encode_head(method, meta, entries))])
            except BaseException as exc:
                self._connection_failed(exc, timeout)
                raise
        except BaseException:
            self._lock.release()
            raise
        return Stream(self, entries, timeout)

    # --- a Stream's side of the channel ------------------------------------------------------------
    # Between ``stream()`` and ``stream_end()`` the lock is held for the Stream, which sends its
    # request's parts and reads its reply through these methods only (one call each, no more per
    # message); they fail like ``call`` does, dropping a connection that is no longer in step.

    def stream_send(self, buffers: list[memoryview], timeout: float | None) -> None:
        """Send the next bytes of the streamed request over the socket."""
        try:
            frame.send_buffers(self._sock, buffers)
        except BaseException as exc:
            self._connection_failed(exc, timeout)
            raise

    def stream_reply(self, into: Mapping[str, torch.Tensor] | None, timeout: float | None, *,
                     head_last: tuple[str, Mapping[str, Any], list[TensorEntry]] | None = None) -> "_Reply":
        """Read the streamed request's reply (tensors into ``into`` where shape and dtype match), first
        sending its head if it goes last (``head_last``: method, meta and entries of a body that is in
        shared memory already)."""
        try:
            if head_last is not None:
                method, meta, entries = head_last
                frame.send_buffers(self._sock, [memoryview(frame.encode_head(method, meta, entries, shared=True))])
            return self._read_reply(into)
        except BaseException as exc:
            self._connection_failed(exc, timeout)
            raise

    def stream_end(self, *, drop_connection: bool = False) -> None:
        """The stream is over: unlock the channel, first closing the connection if the request stopped
        mid-message (the task then sees a truncated message and applies nothing).  Once per stream."""
        if drop_connection:
            self._close()
        self._lock.release()

    # --- internals ---------------------------------------------------------------------------------

    def _connected(self, timeout: float | None) -> socket.socket:
        if self._sock is not None and (self._sock_address != self.address or _closed_by_peer(self._sock)):
            self._close()  # the task moved (a restarted ps listens on a new data port) or closed it (idle)
        if self._sock is None:
            if self.address is None:
                raise errors.UnavailableError("the data port of this task is not known yet: ask its Status first",
                                              task=self.task)
            address = self.address  # set_address may change it meanwhile: connect, check and remember one
            try:
                sock = socket.create_connection(address, timeout=timeout or self.options.deadline_s)
            except OSError as exc:
                raise errors.UnavailableError(f"cannot connect to the data port {address[0]}:{address[1]}: "
                                              f"{exc}", task=self.task) from None
            frame.configure(sock)
            if self._tls is not None:
                sock = self._handshake(sock, address)
            self._sock, self._sock_address = sock, address
            self._reader = frame.Reader(sock, busy_poll_s=self.options.busy_poll_us * 1e-6)
            self._io_timeout = None
            self._tcp_only = not (self.options.shared_memory and _same_host(sock))
            self._bound(timeout)
            if self.options.token:
                self._say_hello()
        self._bound(timeout)
        return self._sock

    def _handshake(self, sock: socket.socket, address: tuple[str, int]) -> ssl.SSLSocket:
        """Wrap a new connection in TLS and shake hands within the connect timeout: the task must present a
        certificate signed by the fleet's CA for the host dialled (``address[0]``, as named by the cluster)."""
        host, port = address
        conn = self._tls.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
        try:
            conn.do_handshake()
        except ssl.SSLCertVerificationError as exc:
            conn.close()
            raise errors.UnavailableError(f"the data port {host}:{port} presented a certificate this client does "
                                          f"not trust ({exc.verify_message}): TENSORFLEET_TLS_CA must be the CA that "
                                          f"signed the tasks' certificates, which must name {host}",
                                          task=self.task) from None
        except ssl.SSLError as exc:
            conn.close()
            raise errors.UnavailableError(f"the TLS handshake with the data port {host}:{port} failed "
                                          f"({exc.reason or exc}): does the task have TLS? TENSORFLEET_TLS_* must be "
                                          "set alike for every task", task=self.task) from None
        except ConnectionError as exc:
            conn.close()
            raise errors.UnavailableError(f"the data port {host}:{port} closed the connection during the TLS "
                                          f"handshake ({exc}): does the task have TLS? TENSORFLEET_TLS_* must be set "
                                          "alike for every task", task=self.task) from None
        except BaseException:
            conn.close()
            raise
        return conn

    def _bound(self, timeout: float | None) -> None:
        """Each send and receive of this call gives up after ``timeout`` s without progress (set only on change)."""
        seconds = timeout or self.options.deadline_s
        if seconds != self._io_timeout:
            frame.set_io_timeouts(self._sock, receive=seconds, send=seconds)
            self._io_timeout = seconds

    def _shared_area(self, request_bytes: int) -> frame.SharedArea | None:
        """The request area for a body of ``request_bytes``, attaching a (larger) segment first if
        needed; None: this body goes over the socket."""
        segment = self._segment
        if self._tcp_only or (segment is None and max(request_bytes, self._largest_reply) < SHARED_MIN_BYTES):
            return None
        if segment is None or request_bytes > segment.request_bytes or self._largest_reply > segment.reply_bytes:
            segment = self._attach(max(request_bytes, segment.request_bytes if segment else 0),
                                   max(self._largest_reply, segment.reply_bytes if segment else 0))
        return None if segment is None else self._request_area

    def _attach(self, request_bytes: int, reply_bytes: int) -> shm.Segment | None:
        """Give the task a new segment for this connection; None if it cannot use one (then TCP only)."""
        segment = shm.Segment.create(request_bytes, reply_bytes)
        if segment is None:
            self._tcp_only = True
            return None
        try:
            frame.send_message(self._sock, ATTACH, {"path": segment.path, "nonce": segment.nonce.hex(),
                                                    "request_bytes": request_bytes, "reply_bytes": reply_bytes})
            self._read_reply(None).result(self.task)
        except errors.InvalidArgumentError as exc:  # it answered: it cannot map ours
            log.info("%s: data bodies stay on TCP: %s", self.task, exc.message)
            self._tcp_only = True
            return None
        finally:
            segment.unlink()  # mapped on both sides now (or refused): the name is no longer needed
        self._segment = segment
        self._request_area = frame.SharedArea(segment.request)
        self._reader.shared_area = frame.SharedArea(segment.reply)
        return segment

    def _say_hello(self) -> None:
        """Prove the job's token without sending it (``auth.proof`` of both nonces, bound to the task we meant to
        reach), only after the task proved it holds the token *as that task*: a process on the task's port that
        does not hold the token, or relays another task's answers, gets no proof of ours to relay in turn."""
        token, client_nonce = self.options.token, auth.new_nonce()
        frame.send_message(self._sock, HELLO, {"nonce": client_nonce})
        challenge, _ = self._read_reply(None).result(self.task)
        server_nonce = challenge.get("nonce")
        if not auth.is_nonce(server_nonce):
            raise errors.UnauthenticatedError("the task answered the Hello without a challenge: it is not a "
                                              "tensorfleet task of this version", task=self.task)
        expected = auth.proof(token, "server", self.task, client_nonce, server_nonce)
        if not hmac.compare_digest(str(challenge.get("proof")).encode("utf-8", "replace"), expected.encode()):
            raise errors.UnauthenticatedError(
                f"the process at {self.address[0]}:{self.address[1]} did not prove it is {self.task} of this job "
                "(another job's task, a different TENSORFLEET_TOKEN, or another process on the task's port); "
                "nothing was sent to it", task=self.task)
        frame.send_message(self._sock, PROVE, {"proof": auth.proof(token, "client", self.task, server_nonce,
                                                                   client_nonce)})
        self._read_reply(None).result(self.task)

    def _read_reply(self, into: Mapping[str, torch.Tensor] | None) -> "_Reply":
        head = self._read_head()
        return _Reply(head.kind, head.meta, self._read_body(head, into))

    def _read_head(self) -> frame.Head:
        head = self._reader.read_head(max_body_bytes=self.options.max_message_bytes)
        if head is None:
            raise errors.UnavailableError("the task closed the connection before replying")
        return head

    def _read_body(self, head: frame.Head, into: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        if head.shared:
            return self._reader.shared_area.read(tuple(head.entries), into, _new_tensor)
        self._largest_reply = max(self._largest_reply, head.body_bytes)
        return read_tensors(self._reader, head.entries, into, _new_tensor)

    def _connection_failed(self, exc: BaseException, timeout: float | None) -> None:
        """A request failed mid-message with ``exc``: drop the connection (whatever failed, it is no longer
        in step) and raise what the caller sees instead: a deadline, UNAVAILABLE, or the task's error
        naming the task.  Returns for anything else, which the caller re-raises as it is."""
        self._close()
        # BlockingIOError: the kernel's bound (EAGAIN); with TLS a receive past Python's timeout is a TimeoutError
        # (and OpenSSL's want-read/want-write, should a bound end one, is the same silence)
        if isinstance(exc, (TimeoutError, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)):
            raise errors.DeadlineExceededError(
                f"no progress on the data connection for {timeout or self.options.deadline_s:g} s",
                task=self.task) from None
        if isinstance(exc, OSError):
            raise errors.UnavailableError(f"the data connection broke: {exc}", task=self.task) from None
        if isinstance(exc, errors.TensorfleetError) and exc.task is None:
            raise type(exc)(exc.message, task=self.task) from None

    def _close(self) -> None:
        if self._sock is not None:
            self._reader.close()
            self._sock.close()
            self._sock = self._reader = None
            self._segment = self._request_area = None

    def close(self) -> None:
        with self._lock:
            self._close()


def _new_tensor(entry: TensorEntry) -> torch.Tensor:
    return torch.empty(entry.shape, dtype=entry.dtype)


def _shut(sock: socket.socket) -> None:
    """Wake and end whatever waits on ``sock`` (a Hello past its time, a server closing), from any thread.

    The descriptor's own shutdown, also for a TLS socket: ``SSLSocket.shutdown`` would drop its TLS
    state under the thread using it (which would then read and write in clear).
    """
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class _Opening:
    """The time a connection has for its opening (TLS handshake, Hello): when it runs out, the socket is shut."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._sock, self._expired, self._lock = sock, False, threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            _shut(self._sock)

    def follow(self, sock: socket.socket) -> None:
        """The connection is ``sock`` now (wrapped in TLS): shut that one when the time runs out."""
        with self._lock:
            self._sock = sock
            if self._expired:
                _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _closed_by_peer(sock: socket.socket) -> bool:
    """The server closed this idle connection (idle timeout, restart): readable with nothing to read.

    With TLS anything readable while idle ends it: the server sends nothing unasked, so it is a
    close_notify, the end of the stream, or bytes out of step.
    """
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if isinstance(sock, ssl.SSLSocket):
            return bool(readable) or sock.pending() > 0
        return bool(readable) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _same_host(sock: socket.socket) -> bool:
    """Whether the peer is on this host as far as addresses tell (the Attach's nonce has the last word)."""
    try:
        peer, local = sock.getpeername()[0], sock.getsockname()[0]
        return peer == local or ipaddress.ip_address(peer).is_loopback
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class _Reply:
    kind: str
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    def result(self, task: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The reply's meta and tensors, or the error the task answered with, as its own class."""
        if self.kind != OK:
            raise errors.from_code(self.kind, str(self.meta.get("message", "")), task=task)
        return self.meta, self.tensors


class Stream:
    """A request being sent piecewise: ``send(i, tensor)`` in entry order, then ``finish()`` for the reply.

    The channel stays locked until ``finish`` or ``abort``; an aborted stream closes the
    connection, so the task sees a truncated message and applies nothing.  Through shared
    memory (``shared``: the area, the method and its meta) tensors are copied into the area
    as they come and the head leaves at ``finish``: an aborted stream sent nothing at all.
    """

    def __init__(self, channel: DataChannel, entries: list[TensorEntry], timeout: float | None, *,
                 shared: tuple[frame.SharedArea, str, Mapping[str, Any]] | None = None) -> None:
        self._channel, self._entries, self._timeout = channel, entries, timeout
        self._shared, self._layout = shared, tuple(entries)
        self._next = 0
        self._open = True

    def send(self, tensor: torch.Tensor) -> None:
        """Send the next entry's tensor (its shape and dtype must match the entry)."""
        entry = self._entries[self._next]
        if not entry.matches(tensor):
            self.abort()
            raise errors.InvalidArgumentError(f"stream expected {entry.name} as {entry.dtype} {entry.shape}, got "
                                              f"{tensor.dtype} {tuple(tensor.shape)}", task=self._channel.task)
        try:
            if self._shared is not None:
                self._shared[0].write(self._layout, [tensor], start=self._next)
            else:
                self._channel.stream_send([frame.tensor_bytes(tensor)], self._timeout)
        except BaseException:
            self._end()
            raise
        self._next += 1

    def finish(self, *, into: Mapping[str, torch.Tensor] | None = None) -> tuple[dict[str, Any], dict]:
        """Wait for the reply (every entry must have been sent)."""
        if self._next != len(self._entries):
            self.abort()
            raise errors.InvalidArgumentError(f"stream finished after {self._next} of {len(self._entries)} tensors",
                                              task=self._channel.task)
        head_last = None  # through shared memory the head leaves now, after the body
        if self._shared is not None:
            _, method, meta = self._shared
            head_last = (method, meta, self._entries)
        try:
            reply = self._channel.stream_reply(into, self._timeout, head_last=head_last)
        finally:
            self._end()
        return reply.result(self._channel.task)

    def abort(self) -> None:
        """Give up: close the connection mid-message (through shared memory nothing was sent yet), so
        nothing of this request is applied."""
        self._end(drop_connection=self._shared is None)

    def _end(self, *, drop_connection: bool = False) -> None:
        """Hand the channel back, once (a failed send already did, and ``abort`` after it does nothing)."""
        if self._open:
            self._open = False
            self._channel.stream_end(drop_connection=drop_connection)
