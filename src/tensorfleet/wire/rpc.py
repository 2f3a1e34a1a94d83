"""gRPC plumbing: servers, channels, deadlines, limits and error statuses.

This is the control plane; pull and push, the data of every step, travel on
``tensorfleet.wire.dataplane``.  The service definition is the table ``METHODS``
below: every method is unary, takes one codec message (``codec.encode``) and
answers one.  gRPC moves opaque bytes (no protobuf, no pickle); all parsing
happens in ``codec.decode``, so a malformed request becomes an INVALID_ARGUMENT
status before any handler runs.

Errors cross the wire as status codes (``TensorfleetError.code``) and come back
as the same tensorfleet error class on the client (``errors.from_code``), so
callers handle one hierarchy.

With a token, a ``Channel`` proves the server before it sends a body or believes a
reply: every server answers ``Hello`` (outside ``METHODS``, before any token check)
with its incarnation and a proof of the token bound to its task, the client's
fresh nonce and that incarnation (``auth.server_proof``).  This happens once per
connection (again after the connection may have changed: it left READY, a call
was UNAVAILABLE, ``reconnect``, ``set_address``), never per call; every call's
proof then names the incarnation, which a restarted task refuses.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeAlias

import grpc

from tensorfleet import errors
from tensorfleet.cluster.environment import env_switch
from tensorfleet.errors import ConfigError
from tensorfleet.wire import auth, codec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SERVICE = "tensorfleet.ParameterServer"
METHODS = (
    "Init",    # chief -> ps: initial values + optimizer; refused politely if already initialized
    "Snapshot",  # chief -> ps: the whole shard (values, optimizer slots, averages, counters) for a checkpoint
    "Status",  # anyone -> ps: initialized?, global step, counters, the data plane's port
    "Done",    # worker -> ps: this worker finished (the ps exits when all have); coordinator -> worker: no more work
    "Resize",  # launcher -> ps: the job's workers are now 0..N-1 (an asynchronous job scaled up or down)
    "Rendezvous",  # worker -> ps 0: the collective's meeting place (hybrid mode's dense all-reduce), a key at a time
    "Run",     # coordinator -> worker: run one of the script's remote functions (in-graph replication)
    # chief -> worker, placing a model's parts (tensorfleet.protocol.placement; Done releases the worker):
    "Join",    # a chief's session starts, or renews its lease
    "Place",   # build a module from a name the worker resolves itself (torch.nn, @tfl.placeable), JSON arguments
    "Forward", "Backward",  # a placed module's forward (inputs in, outputs out) and its backward (gradients)
    "Optimizer", "Step",  # a placed module's optimizer (torch.optim, by name): make it, step it
    "State", "LoadState",  # a placed module's state dict, read and written
)

# Answered by every server, before the token check: the client's challenge (a nonce in the metadata), the server's
# incarnation and proof. Not in METHODS: no handler of a task's own serves it.
HELLO = "Hello"
HELLO_MAX_BYTES = 64 * 1024  # a Hello's answer is a few hundred bytes
PROVE_TRIES = 3  # Hellos tried while the connection keeps changing under them
# In the refusal of a call whose proof names another incarnation: the client proves the task again and resends.
ANOTHER_INCARNATION = "was made for another incarnation of"

# What one task's gRPC port holds at once (see server_limits).
MAX_CONNECTIONS = 256
HANDSHAKE_TIMEOUT_S = 10.0
IDLE_CLOSE_S = 60.0

Message: TypeAlias = "tuple[dict[str, Any], dict[str, torch.Tensor]]"
Handler: TypeAlias = "Callable[[dict[str, Any], dict[str, torch.Tensor]], Message]"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for TLS on both planes: this task's certificate and key (servers), and the CA that signed
    the fleet's certificates (clients, which check that the certificate names the host they dial).

    gRPC uses them through ``server_credentials`` / ``channel_credentials``, the data plane
    (``tensorfleet.wire.dataserver``, ``datachannel``) through ``server_context`` / ``client_context``: with TLS set,
    gradients and values are encrypted and authenticated on the path too.  Bodies between tasks on
    one host may still go through shared memory (``tensorfleet.wire.shm``): they never cross a network.
    """

    cert: str
    key: str
    ca: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "TlsFiles | None":
        """From ``TENSORFLEET_TLS_CERT``, ``TENSORFLEET_TLS_KEY`` and ``TENSORFLEET_TLS_CA``; None if none is set."""
        environ = os.environ if environ is None else environ
        paths = {name: environ.get(f"TENSORFLEET_TLS_{name.upper()}") for name in ("cert", "key", "ca")}
        if not any(paths.values()):
            return None
        missing = [f"TENSORFLEET_TLS_{name.upper()}" for name, path in paths.items() if not path]
        if missing:
            raise ConfigError(f"TLS needs all of TENSORFLEET_TLS_CERT, TENSORFLEET_TLS_KEY and TENSORFLEET_TLS_CA; "
                              f"missing {', '.join(missing)}")
        return cls(**paths)

    def read(self, name: str) -> bytes:
        path = getattr(self, name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"TLS {name} file {path!r} cannot be read: {exc.strerror}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.read("key"), self.read("cert"))])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.read("ca"))

    def server_context(self) -> ssl.SSLContext:
        """The data server's TLS context: this task's certificate and key, TLS 1.2 at least (1.3 when both
        sides have it, which Python's ssl picks first)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.num_tickets = 0  # no session resumption: a connection lives long; nothing arrives after the handshake
        try:
            context.load_cert_chain(self.cert, self.key)
        except FileNotFoundError as exc:
            raise ConfigError(f"TLS certificate or key file {exc.filename or self.cert!r} cannot be read: "
                              f"{exc.strerror}") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"TLS certificate {self.cert!r} and key {self.key!r} cannot be loaded: {exc}") from None
        return context

    def client_context(self) -> ssl.SSLContext:
        """A data channel's TLS context: the fleet's CA, the server's certificate checked and its name
        matched against the host dialled (``check_hostname``), TLS 1.2 at least."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_verify_locations(cafile=self.ca)
        except FileNotFoundError as exc:
            raise ConfigError(f"TLS ca file {self.ca!r} cannot be read: {exc.strerror}") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"TLS ca file {self.ca!r} cannot be loaded: {exc}") from None
        return context


BUSY_POLL_ENV = "TENSORFLEET_BUSY_POLL_US"
MAX_BUSY_POLL_US = 100_000


def busy_poll_from_env() -> float:
    """``TENSORFLEET_BUSY_POLL_US`` as microseconds (0 when unset)."""
    text = os.environ.get(BUSY_POLL_ENV, "").strip()
    try:
        value = float(text) if text else 0.0
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_BUSY_POLL_US:
        raise ConfigError(f"{BUSY_POLL_ENV}={text!r}: give microseconds in 0..{MAX_BUSY_POLL_US} (0 or unset: "
                          "never poll)")
    return value


SHARED_MEMORY_ENV = "TENSORFLEET_SHARED_MEMORY"


def shared_memory_from_env() -> bool:
    """``TENSORFLEET_SHARED_MEMORY``: on unless set to 0 / false / off."""
    return env_switch(SHARED_MEMORY_ENV, default=True,
                      meaning="1 (the default: bodies between tasks on one host go through shared memory) or 0 "
                              "(always TCP)")


@dataclass(frozen=True)
class WireOptions:
    """Limits every channel and server obeys.

    Args:
        max_message_bytes: largest message sent or received; bigger ones are refused with a clear status.
        deadline_s: default deadline of one RPC.
        token: the job's shared secret, sent with every call and required of every caller (None: no
            authentication). By default from ``TENSORFLEET_TOKEN`` / ``TENSORFLEET_TOKEN_FILE`` when the
            options are created (see ``tensorfleet.wire.auth``).
        tls: certificate files for TLS on gRPC and the data plane (None: plaintext); by default from
            ``TENSORFLEET_TLS_*``.
        busy_poll_us: how long a data connection waiting for a message polls before it sleeps (0: never;
            see ``tensorfleet.wire.frame.Reader``). By default from ``TENSORFLEET_BUSY_POLL_US``, which
            ``tensorfleet launch`` sets when every task has a core of its own.
        shared_memory: move the bodies of data-plane messages between tasks on one host through shared
            memory (see ``tensorfleet.wire.shm``); False: always TCP. By default from
            ``TENSORFLEET_SHARED_MEMORY`` (on unless 0).
    """

    max_message_bytes: int = 1024 * 1024 * 1024
    deadline_s: float = 60.0
    token: str | None = field(default_factory=auth.job_token, repr=False)
    tls: TlsFiles | None = field(default_factory=TlsFiles.from_env)
    busy_poll_us: float = field(default_factory=busy_poll_from_env)
    shared_memory: bool = field(default_factory=shared_memory_from_env)

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} is too small; use at least 1024")
        if self.deadline_s <= 0:
            raise ValueError(f"deadline_s={self.deadline_s} must be positive")
        if not 0 <= self.busy_poll_us <= MAX_BUSY_POLL_US:
            raise ValueError(f"busy_poll_us={self.busy_poll_us} must be in 0..{MAX_BUSY_POLL_US}")

    def grpc_options(self) -> list[tuple[str, int]]:
        return [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.so_reuseport", 0),
                # A restarted ps must be found again within a second, not after gRPC's default
                # exponential backoff (up to 120 s).
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                # Subchannels of their own: a channel stuck on a dead connection is not shared with
                # others, and reconnect() really starts afresh.
                ("grpc.use_local_subchannel_pool", 1)]


def server_limits() -> list[tuple[str, int]]:
    """What a stranger can hold of a task's gRPC port before any call proves the token (a connection proves
    nothing): at most ``MAX_CONNECTIONS`` connections (more are closed as they come), each given
    ``HANDSHAKE_TIMEOUT_S`` to open (TLS and HTTP/2) and closed after ``IDLE_CLOSE_S`` without a call; the job's
    own channels open a new connection on their next call. With the data plane's own bounds this keeps a
    task's file descriptors for its job (``ps/server.py`` checks the process may hold them all)."""
    return [("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
            ("grpc.max_connection_idle_ms", int(IDLE_CLOSE_S * 1000))]


def _status_for(exc: errors.TensorfleetError) -> grpc.StatusCode:
    return grpc.StatusCode[exc.code]


def _error_for(code: grpc.StatusCode, detail: str, task: str) -> errors.TensorfleetError:
    return errors.from_code(code.name, detail, task=task)


class _TokenCheck(grpc.ServerInterceptor):
    """Answer ``Hello`` (anyone may ask a task to prove itself), and refuse any other call without a proof of the
    job's token for this incarnation when it starts, from its metadata, before its message is read: handlers that
    never read the request, so a stranger's gigabyte is never buffered (only what HTTP/2 flow control lets in
    before the stream is reset)."""

    def __init__(self, gate: auth.Gate, task: str) -> None:
        self._gate, self._task, self._last_warning = gate, task, 0.0
        self._hello_method = f"/{SERVICE}/{HELLO}"
        self._hello = grpc.stream_unary_rpc_method_handler(self._answer_hello)
        self._refusal = grpc.stream_unary_rpc_method_handler(self._refuse)
        self._stale = grpc.stream_unary_rpc_method_handler(self._refuse_stale)

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        if details.method == self._hello_method:
            return self._hello
        if not self._gate.required:
            return continuation(details)
        presented = _metadata_value(details.invocation_metadata, auth.METADATA_KEY)
        if self._gate.admits_call(presented, details.method):
            return continuation(details)
        stale = self._gate.names_another_incarnation(presented)
        now = time.monotonic()
        if now - self._last_warning >= 10.0:  # a flood of refusals must not flood the log
            self._last_warning = now
            log.warning("%s: refused a call to %s %s (%d refused so far)", self._task, details.method,
                        "whose proof names another incarnation of this task" if stale else
                        "without the job's token", self._gate.refused)
        return self._stale if stale else self._refusal

    def _answer_hello(self, requests: Any, context: grpc.ServicerContext) -> bytes:
        try:
            answer = self._gate.hello(_metadata_value(context.invocation_metadata(), auth.HELLO_KEY))
        except ValueError as exc:  # counted by the gate
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self._task}: {exc}")
        return codec.encode(answer)

    def _refuse(self, requests: Any, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self._task} refuses calls without the job's token: "
                      "set TENSORFLEET_TOKEN (or TENSORFLEET_TOKEN_FILE) to the token of this job (a proof of it "
                      f"is made for one task: a channel must name the task it calls, {self._task})")
        raise AssertionError("unreachable")  # context.abort always raises

    def _refuse_stale(self, requests: Any, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self._task} refuses a call whose proof "
                      f"{ANOTHER_INCARNATION} this task (it restarted since, or the proof was recorded): the job's "
                      "own channels prove the task again and resend")
        raise AssertionError("unreachable")  # context.abort always raises


def _metadata_value(metadata: Any, key: str) -> str | None:
    """The value of ``key`` in a call's metadata (None without one)."""
    return next((value for key_, value in metadata or () if key_ == key), None)


def _wrap(handler: Handler, options: WireOptions, task: str,
          gate: auth.Gate) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:  # the proof was checked: _TokenCheck
        if gate.required:  # ... and now that the request is read, that it is the request the proof covers
            if not gate.admits_request(_metadata_value(context.invocation_metadata(), auth.METADATA_KEY), request):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{task} refuses a request that is not the one its "
                              "proof was made for")
        try:
            meta, tensors = codec.decode(request, max_bytes=options.max_message_bytes)
            reply_meta, reply_tensors = handler(meta, tensors)
            return codec.encode(reply_meta, reply_tensors)
        except errors.TensorfleetError as exc:
            context.abort(_status_for(exc), exc.message)
        except Exception as exc:  # a bug must not take the server down: report it, keep serving
            log.exception("%s: unexpected error in handler", task)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")  # context.abort always raises
    return unary


def start_server(address: str, handlers: Mapping[str, Handler], *, task: str,
                 options: WireOptions | None = None, max_workers: int = 8,
                 gate: auth.Gate | None = None) -> tuple[grpc.Server, int]:
    """Serve ``handlers`` (method name -> handler) on ``address``; return the server and the bound port.

    Every call must carry ``options.token`` (checked by ``gate``, which counts refusals; pass the
    task's shared gate so that gRPC and data-plane refusals add up).

    Raises:
        UnavailableError: the address cannot be bound (already in use, or not an address of this machine).
    """
    options = options or WireOptions()  # built now, not at import: the environment of this moment
    unknown = set(handlers) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown RPC method(s) {sorted(unknown)}: the service defines {METHODS}")
    gate = (gate if gate is not None else auth.Gate(options.token, task)).check_guards(task)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"rpc-{task}"),
                         options=options.grpc_options() + server_limits(), interceptors=[_TokenCheck(gate, task)])
    method_handlers = {name: grpc.unary_unary_rpc_method_handler(_wrap(h, options, task, gate))
                       for name, h in handlers.items()}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, method_handlers)])
    try:
        port = (server.add_secure_port(address, options.tls.server_credentials()) if options.tls
                else server.add_insecure_port(address))
    except RuntimeError as exc:
        raise errors.UnavailableError(f"cannot listen on {address}: {exc} (is the port in use?)", task=task) from None
    if port == 0:
        raise errors.UnavailableError(f"cannot listen on {address}: the port is in use or the host is not local",
                                      task=task)
    server.start()
    return server, port


class RpcFuture:
    """The pending reply of an async call; ``result()`` decodes it or raises a tensorfleet error.

    An UNAVAILABLE answer drops the channel's proof of the server (the connection may have changed); a refusal
    of a proof made for another incarnation (the task restarted between the proof and the call) proves the task
    again and sends the request once more (it was refused before it was read)."""

    def __init__(self, inner: grpc.Future | None, task: str, options: WireOptions, *,
                 channel: "Channel | None" = None, resend: Callable[[], "RpcFuture"] | None = None,
                 error: errors.TensorfleetError | None = None) -> None:
        self._inner, self._task, self._options = inner, task, options
        self._channel, self._resend, self._error = channel, resend, error

    @classmethod
    def failed(cls, error: errors.TensorfleetError, task: str, options: WireOptions) -> "RpcFuture":
        """A call that was never sent (the server could not be proven): ``result()`` raises ``error``."""
        return cls(None, task, options, error=error)

    def result(self) -> Message:
        if self._inner is None:
            assert self._error is not None
            raise self._error
        try:
            reply = self._inner.result()
        except grpc.RpcError as exc:
            code, detail = exc.code(), exc.details() or ""
            if self._channel is not None and (code == grpc.StatusCode.UNAVAILABLE or (
                    code == grpc.StatusCode.UNAUTHENTICATED and ANOTHER_INCARNATION in detail)):
                self._channel.invalidate()
                if code == grpc.StatusCode.UNAUTHENTICATED and self._resend is not None:
                    return self._resend().result()
            raise _error_for(code, detail, self._task) from None
        return codec.decode(reply, max_bytes=self._options.max_message_bytes)

    def done(self) -> bool:
        return self._inner is None or self._inner.done()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        if self._inner is None:
            callback()
        else:
            self._inner.add_done_callback(lambda _inner: callback())


class _AfterHello(RpcFuture):
    """A call on a connection not proven yet: its ``Hello`` is in flight, and the call is sent only once that
    proved the server (when ``result`` or ``done`` is asked, or a done callback runs), never before. So calls
    to several tasks started together prove them together (the launcher's monitor asks every task at once)."""

    def __init__(self, hello: grpc.Future, then: Callable[[], RpcFuture], task: str, options: WireOptions) -> None:
        super().__init__(hello, task, options)
        self._then, self._sent, self._sending = then, None, threading.Lock()

    def _call(self) -> RpcFuture:
        with self._sending:
            if self._sent is None:
                self._sent = self._then()  # waits for the Hello, checks it, then sends (or fails: nothing sent)
            return self._sent

    def result(self) -> Message:
        return self._call().result()

    def done(self) -> bool:
        assert self._inner is not None
        return self._inner.done() and self._call().done()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        assert self._inner is not None
        self._inner.add_done_callback(lambda _hello: self._call().add_done_callback(callback))


class Channel:
    """A client connection to one task: ``call`` / ``call_async`` with a deadline on every RPC.

    With a token, the server proves itself (``Hello``, see the module's docstring) before the first call on each
    connection: one that fails gets no body and is an ``UnprovenServerError`` (counted in ``servers_refused``).

    Example:
        >>> ch = Channel("127.0.0.1:2222", task="/job:ps/task:0")       # doctest: +SKIP
        >>> meta, _ = ch.call("Status")                                  # doctest: +SKIP
    """

    def __init__(self, address: str, *, task: str, options: WireOptions | None = None) -> None:
        options = options or WireOptions()
        self.address, self.task, self.options = address, task, options
        self.incarnation: str | None = None  # the server's, proven on the current connection (None: prove first)
        self.servers_refused = 0  # servers at this address that failed the proof
        self._proving = threading.Lock()  # prove(): one Hello at a time
        self._epoch = 0  # bumped whenever the connection may have changed: a proof older than that is void
        self._last_warning = 0.0
        self._open()

    def _open(self) -> None:
        if self.options.tls:
            self._channel = grpc.secure_channel(self.address, self.options.tls.channel_credentials(),
                                                options=self.options.grpc_options())
        else:
            self._channel = grpc.insecure_channel(self.address, options=self.options.grpc_options())
        self._stubs = {name: self._channel.unary_unary(f"/{SERVICE}/{name}") for name in METHODS}
        self._hello = self._channel.unary_unary(f"/{SERVICE}/{HELLO}")
        self.invalidate()
        self._watching = None
        if self.options.token:
            self._watching = self._watcher(self._channel)
            self._channel.subscribe(self._watching, try_to_connect=False)

    def _close_channel(self) -> None:
        """Close the channel, its connectivity watcher unsubscribed first: gRPC's polling thread then ends at its
        next look (within 0.2 s) instead of asking a closed channel, which it reports as a ValueError traceback."""
        if self._watching is not None:
            self._channel.unsubscribe(self._watching)
            self._watching = None
        self._channel.close()

    def _watcher(self, watched: grpc.Channel) -> Callable[[grpc.ChannelConnectivity], None]:
        """A callback for ``watched``'s connectivity (from gRPC's polling thread, which may miss a passing state):
        leaving READY, a failure, or CONNECTING back to IDLE (a READY missed) means the connection went, and the
        next one may lead to another process. Connecting (to CONNECTING, to READY) changes nothing proven."""
        last: list[grpc.ChannelConnectivity | None] = [None]  # None: the state delivered first, on subscribing
        state_ = grpc.ChannelConnectivity

        def changed(state: grpc.ChannelConnectivity) -> None:
            before, last[0] = last[0], state
            log.debug("%s at %s: connection %s -> %s", self.task, self.address, before, state)
            went = before is state_.READY or state in (state_.TRANSIENT_FAILURE, state_.SHUTDOWN) or (
                before is state_.CONNECTING and state is state_.IDLE)
            if went and watched is self._channel:
                self.invalidate()
        return changed

    def invalidate(self) -> None:
        """Forget the server's proof: the connection may have changed, so the next call proves the task again."""
        self._epoch += 1
        self.incarnation = None

    def reconnect(self) -> None:
        """Drop the connection and start a new one: after a task restarted, the old one can linger."""
        self._close_channel()
        self._open()

    def set_address(self, address: str) -> None:
        """Dial ``address`` from now on: the task moved (a backend started it again elsewhere)."""
        self._close_channel()
        self.address = address
        self._open()

    def prove(self, *, timeout: float | None = None, wait_for_ready: bool = False) -> str:
        """The server's incarnation, proven on the current connection (a ``Hello`` when not yet proven).

        Raises:
            UnprovenServerError: what answers is not this task of this job (counted; nothing was sent to it).
            UnavailableError, DeadlineExceededError: nothing answers (yet).
        """
        with self._proving:
            for _ in range(PROVE_TRIES):
                if self.incarnation is not None:
                    return self.incarnation
                epoch, nonce, hello = self._start_hello(timeout, wait_for_ready)
                incarnation = self._proven_by(hello, nonce)
                if self._keep_proof(epoch, incarnation):
                    return incarnation
            raise self._kept_changing()

    def _start_hello(self, timeout: float | None, wait_for_ready: bool) -> tuple[int, str, grpc.Future]:
        """Send a Hello with a fresh nonce: (the connection's epoch now, the nonce, the pending answer)."""
        nonce = auth.new_nonce()
        return self._epoch, nonce, self._hello.future(b"", timeout=timeout or self.options.deadline_s,
                                                      wait_for_ready=wait_for_ready,
                                                      metadata=((auth.HELLO_KEY, nonce),))

    def _keep_proof(self, epoch: int, incarnation: str) -> bool:
        """Take ``incarnation`` as proven unless the connection may have changed since the Hello was sent."""
        if epoch != self._epoch:
            return False
        self.incarnation = incarnation
        return True

    def _kept_changing(self) -> errors.UnavailableError:
        return errors.UnavailableError(f"the connection to {self.address} kept changing while the task was asked "
                                       "to prove itself", task=self.task)

    def _proven_by(self, hello: grpc.Future, nonce: str) -> str:
        """The incarnation a Hello's answer proves (waiting for it), or the error saying what answered instead."""
        assert self.options.token is not None
        try:
            reply = hello.result()
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                raise _error_for(code, exc.details() or "", self.task) from None  # nothing there (yet)
            raise self._unproven(f"answered its Hello with {code.name} ({(exc.details() or '')[:120]!r}): it is not "
                                 "a tensorfleet task of this version") from None
        try:
            answer, _ = codec.decode(reply, max_bytes=HELLO_MAX_BYTES)
        except errors.WireError:
            raise self._unproven("answered its Hello with something that is not a tensorfleet answer") from None
        claimed, incarnation, presented = answer.get("task"), answer.get("incarnation"), answer.get("proof")
        if presented is None:
            raise self._unproven(f"answered without proving it holds the job's token (it says it is "
                                 f"{str(claimed)[:80]!r}; a task started without TENSORFLEET_TOKEN, or another "
                                 "program on the port)")
        if not auth.proves_server(self.options.token, self.task, nonce, incarnation, presented):
            raise self._unproven(f"did not prove it is {self.task} of this job (another job's task, a different "
                                 "TENSORFLEET_TOKEN, or another process on the task's port)")
        assert isinstance(incarnation, str)
        return incarnation

    def _unproven(self, found: str) -> errors.UnprovenServerError:
        """Count and say what was found at the address; the caller raises it (nothing was sent)."""
        self.servers_refused += 1
        error = errors.UnprovenServerError(
            f"the process at {self.address} {found}; nothing was sent to it and nothing it says is believed. Stop "
            f"what holds {self.address}, or give {self.task} and this process the same job token (TENSORFLEET_TOKEN "
            "or TENSORFLEET_TOKEN_FILE)", task=self.task)
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            log.warning("%s (%d such answers so far)", error, self.servers_refused)
        return error

    def call_async(self, method: str, meta: Mapping[str, Any] | None = None,
                   tensors: Mapping[str, torch.Tensor] | None = None, *,
                   timeout: float | None = None, wait_for_ready: bool = False) -> RpcFuture:
        request = codec.encode(meta, tensors)
        if len(request) > self.options.max_message_bytes:
            raise errors.WireError(f"{method} request of {len(request)} bytes exceeds the limit of "
                                   f"{self.options.max_message_bytes} bytes", task=self.task)
        return self._send(method, request, timeout, wait_for_ready, resend=True)

    def _send(self, method: str, request: bytes, timeout: float | None, wait_for_ready: bool, *,
              resend: bool, tries: int = PROVE_TRIES) -> RpcFuture:
        metadata = None
        if self.options.token:
            incarnation = self.incarnation
            if incarnation is None:
                return self._after_hello(method, request, timeout, wait_for_ready, resend=resend, tries=tries)
            # Not the token: a proof of it for this call (method, task, time, fresh nonce, the server's
            # incarnation, this request's digest), useless to a listener: not again, not at another task or
            # incarnation, not with another request.
            metadata = ((auth.METADATA_KEY, auth.call_proof(self.options.token, f"/{SERVICE}/{method}", self.task,
                                                            request, incarnation=incarnation)),)
        inner = self._stubs[method].future(request, timeout=timeout or self.options.deadline_s,
                                           wait_for_ready=wait_for_ready, metadata=metadata)
        again = (lambda: self._send(method, request, timeout, wait_for_ready, resend=False)) if resend else None
        return RpcFuture(inner, self.task, self.options, channel=self, resend=again)

    def _after_hello(self, method: str, request: bytes, timeout: float | None, wait_for_ready: bool, *,
                     resend: bool, tries: int) -> RpcFuture:
        """The call, sent once a Hello sent now has proven the server; a server that fails it is sent nothing."""
        epoch, nonce, hello = self._start_hello(timeout, wait_for_ready)

        def then() -> RpcFuture:
            try:
                incarnation = self._proven_by(hello, nonce)
            except errors.TensorfleetError as exc:  # unproven, or not there: nothing is sent
                return RpcFuture.failed(exc, self.task, self.options)
            if not self._keep_proof(epoch, incarnation) and tries <= 1:
                return RpcFuture.failed(self._kept_changing(), self.task, self.options)
            return self._send(method, request, timeout, wait_for_ready, resend=resend, tries=tries - 1)
        return _AfterHello(hello, then, self.task, self.options)

    def call(self, method: str, meta: Mapping[str, Any] | None = None,
             tensors: Mapping[str, torch.Tensor] | None = None, *,
             timeout: float | None = None, wait_for_ready: bool = False) -> Message:
        return self.call_async(method, meta, tensors, timeout=timeout, wait_for_ready=wait_for_ready).result()

    def close(self) -> None:
        self._close_channel()
