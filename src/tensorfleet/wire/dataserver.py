"""The data plane's server: ``DataServer`` serves a task's methods on its data port (``tensorfleet.wire.dataplane``).

Server: one thread per connection reads a request head, lets the method choose
where the body goes (``Request.receive``; a method that refuses the request
before that has its body skipped, so the connection stays usable), and sends the
``Reply``.  Errors travel as status codes (``TensorfleetError.code``); a
malformed stream gets an error reply and the connection is closed.  A bug in a
method becomes an INTERNAL reply, never a dead server.

A stranger's cost is bounded before it has said ``Hello`` (the caps below).  With TLS the
handshake happens on the connection's own thread, within the same ``HELLO_TIMEOUT_S`` as
the Hello (a stranger holds neither the accepting thread nor a thread for longer).
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
import threading
import time
from typing import Mapping

from tensorfleet import errors
from tensorfleet.wire import auth, frame, shm
from tensorfleet.wire.dataplane import ATTACH, HELLO, OK, PROVE, BufferPool, Method, Request
from tensorfleet.wire.rpc import SHARED_MEMORY_ENV, WireOptions

log = logging.getLogger(__name__)

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
                # The challenge: our nonce, incarnation and proof (the client checks we hold the token too, as this
                # task in this incarnation), then its proof.
                server_nonce, incarnation = auth.new_nonce(), self.gate.incarnation
                ours = self.gate.proof("server", client_nonce, f"{server_nonce}/{incarnation}")
                frame.send_message(sock, OK, {"nonce": server_nonce, "incarnation": incarnation, "proof": ours})
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
