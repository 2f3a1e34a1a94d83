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
"""

from __future__ import annotations

import logging
import os
import ssl
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
    "Run",     # coordinator -> worker: run one of the script's remote functions (in-graph replication)
)

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
    """Refuse a call without the job's token when it starts, from its metadata, before its message is read:
    a handler that never reads the request, so a stranger's gigabyte is never buffered (only what HTTP/2
    flow control lets in before the stream is reset)."""

    def __init__(self, gate: auth.Gate, task: str) -> None:
        self._gate, self._task, self._last_warning = gate, task, 0.0
        self._refusal = grpc.stream_unary_rpc_method_handler(self._refuse)

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        if not self._gate.required:
            return continuation(details)
        if self._gate.admits_call(_presented_proof(details.invocation_metadata), details.method):
            return continuation(details)
        now = time.monotonic()
        if now - self._last_warning >= 10.0:  # a flood of refusals must not flood the log
            self._last_warning = now
            log.warning("%s: refused a call to %s without the job's token (%d refused so far)", self._task,
                        details.method, self._gate.refused)
        return self._refusal

    def _refuse(self, requests: Any, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self._task} refuses calls without the job's token: "
                      "set TENSORFLEET_TOKEN (or TENSORFLEET_TOKEN_FILE) to the token of this job (a proof of it "
                      f"is made for one task: a channel must name the task it calls, {self._task})")
        raise AssertionError("unreachable")  # context.abort always raises


def _presented_proof(metadata: Any) -> str | None:
    """The call proof a call's metadata carries (None without one)."""
    return next((value for key, value in metadata or () if key == auth.METADATA_KEY), None)


def _wrap(handler: Handler, options: WireOptions, task: str,
          gate: auth.Gate) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:  # the proof was checked: _TokenCheck
        if gate.required:  # ... and now that the request is read, that it is the request the proof covers
            if not gate.admits_request(_presented_proof(context.invocation_metadata()), request):
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
    """The pending reply of an async call; ``result()`` decodes it or raises a tensorfleet error."""

    def __init__(self, inner: grpc.Future, task: str, options: WireOptions) -> None:
        self._inner, self._task, self._options = inner, task, options

    def result(self) -> Message:
        try:
            reply = self._inner.result()
        except grpc.RpcError as exc:
            raise _error_for(exc.code(), exc.details() or "", self._task) from None
        return codec.decode(reply, max_bytes=self._options.max_message_bytes)

    def done(self) -> bool:
        return self._inner.done()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        self._inner.add_done_callback(lambda _inner: callback())


class Channel:
    """A client connection to one task: ``call`` / ``call_async`` with a deadline on every RPC.

    Example:
        >>> ch = Channel("127.0.0.1:2222", task="/job:ps/task:0")       # doctest: +SKIP
        >>> meta, _ = ch.call("Status")                                  # doctest: +SKIP
    """

    def __init__(self, address: str, *, task: str, options: WireOptions | None = None) -> None:
        options = options or WireOptions()
        self.address, self.task, self.options = address, task, options
        self._open()

    def _open(self) -> None:
        if self.options.tls:
            self._channel = grpc.secure_channel(self.address, self.options.tls.channel_credentials(),
                                                options=self.options.grpc_options())
        else:
            self._channel = grpc.insecure_channel(self.address, options=self.options.grpc_options())
        self._stubs = {name: self._channel.unary_unary(f"/{SERVICE}/{name}") for name in METHODS}

    def reconnect(self) -> None:
        """Drop the connection and start a new one: after a task restarted, the old one can linger."""
        self._channel.close()
        self._open()

    def set_address(self, address: str) -> None:
        """Dial ``address`` from now on: the task moved (a backend started it again elsewhere)."""
        self._channel.close()
        self.address = address
        self._open()

    def call_async(self, method: str, meta: Mapping[str, Any] | None = None,
                   tensors: Mapping[str, torch.Tensor] | None = None, *,
                   timeout: float | None = None, wait_for_ready: bool = False) -> RpcFuture:
        request = codec.encode(meta, tensors)
        if len(request) > self.options.max_message_bytes:
            raise errors.WireError(f"{method} request of {len(request)} bytes exceeds the limit of "
                                   f"{self.options.max_message_bytes} bytes", task=self.task)
        # Not the token: a proof of it for this call (method, task, time, fresh nonce, this request's digest),
        # useless to a listener: not again, not at another task, not with another request.
        metadata = ((auth.METADATA_KEY, auth.call_proof(self.options.token, f"/{SERVICE}/{method}", self.task,
                                                        request)),) if self.options.token else None
        inner = self._stubs[method].future(request, timeout=timeout or self.options.deadline_s,
                                           wait_for_ready=wait_for_ready, metadata=metadata)
        return RpcFuture(inner, self.task, self.options)

    def call(self, method: str, meta: Mapping[str, Any] | None = None,
             tensors: Mapping[str, torch.Tensor] | None = None, *,
             timeout: float | None = None, wait_for_ready: bool = False) -> Message:
        return self.call_async(method, meta, tensors, timeout=timeout, wait_for_ready=wait_for_ready).result()

    def close(self) -> None:
        self._channel.close()
