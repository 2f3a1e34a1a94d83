"""The data plane's client: ``DataChannel`` and ``Stream`` (see ``tensorfleet.wire.dataplane``).

Client: ``DataChannel`` is one connection, one request at a time, connected on
first use and again after a failure; a broken connection is UNAVAILABLE
(recoverable: the ps may be restarting), silence past the deadline is
DEADLINE_EXCEEDED.  ``Stream`` sends one request whose tensors are handed over
one by one as they become ready (gradients during backward).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import select
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from tensorfleet import errors
from tensorfleet.wire import auth, frame, shm
from tensorfleet.wire.codec import TensorEntry
from tensorfleet.wire.dataplane import ATTACH, HELLO, OK, PROVE, read_tensors
from tensorfleet.wire.rpc import WireOptions

log = logging.getLogger(__name__)

# Smaller bodies stay on the socket: a segment costs a round trip and its pages to set up, and at
# 4 KiB the two paths move bytes alike (benchmarks/wire_throughput.py); at 64 KiB the segment wins.
SHARED_MIN_BYTES = 64 * 1024


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
        self.incarnation: str | None = None  # the task's, as the last connection's Hello proved it (with a token)
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
        reach), only after the task proved it holds the token *as that task* (its proof binds its incarnation too,
        kept in ``incarnation``): a process on the task's port that does not hold the token, or relays another
        task's answers, gets no proof of ours to relay in turn."""
        token, client_nonce = self.options.token, auth.new_nonce()
        frame.send_message(self._sock, HELLO, {"nonce": client_nonce})
        challenge, _ = self._read_reply(None).result(self.task)
        server_nonce, incarnation = challenge.get("nonce"), challenge.get("incarnation")
        if not (auth.is_nonce(server_nonce) and auth.is_nonce(incarnation)):
            raise errors.UnauthenticatedError("the task answered the Hello without a challenge: it is not a "
                                              "tensorfleet task of this version", task=self.task)
        expected = auth.proof(token, "server", self.task, client_nonce, f"{server_nonce}/{incarnation}")
        if not hmac.compare_digest(str(challenge.get("proof")).encode("utf-8", "replace"), expected.encode()):
            raise errors.UnauthenticatedError(
                f"the process at {self.address[0]}:{self.address[1]} did not prove it is {self.task} of this job "
                "(another job's task, a different TENSORFLEET_TOKEN, or another process on the task's port); "
                "nothing was sent to it", task=self.task)
        frame.send_message(self._sock, PROVE, {"proof": auth.proof(token, "client", self.task, server_nonce,
                                                                   client_nonce)})
        self._read_reply(None).result(self.task)
        self.incarnation = incarnation

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
