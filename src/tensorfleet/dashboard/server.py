"""The dashboard's web app, and a uvicorn server for it in a background thread.

The app only reads: every request calls the ``picture()`` it was given (the
fleet monitor's latest view of every task, see ``tensorfleet.dashboard``) and
renders it as the page's JSON, as Prometheus metrics, or not at all (the page
and its static files).  Nothing here talks to the tasks.

The server runs in a thread of the launcher, whose main thread owns Ctrl-C, so
it never installs signal handlers.  It binds its socket itself before the
thread starts: ``start()`` returns with the port already listening (and known,
even for port 0), and a port that is taken fails in the caller's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import threading
import time
from importlib import resources
from types import TracebackType
from typing import Any, Callable, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tensorfleet.dashboard.metrics import CONTENT_TYPE, render_metrics
from tensorfleet.errors import LaunchError

__all__ = ["BodyLimit", "Dashboard", "FleetPicture", "PictureSource", "create_app", "json_safe"]

# The fleet as the dashboard shows it, a JSON-ready dict (its shape: see ``tensorfleet.dashboard``).
# A "picture", not a "snapshot": that is a ps shard's state taken for a checkpoint (the Snapshot RPC).
FleetPicture = dict[str, Any]
# Where the dashboard gets it: ``FleetMonitor.picture`` (or a test's stand-in); cheap, thread-safe,
# a fresh dict each call.
PictureSource = Callable[[], FleetPicture]

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0  # the longest a request body may take to arrive (BodyLimit)
STOP_TIMEOUT_S = 5.0
STOP_POLL_S = 0.2  # how often wait_for_stop_signal looks for a signal that reached another thread

# The page builds its DOM with textContent only; the policy is the second line of defence
# against a task name that carries markup.  uPlot positions its elements with inline styles.
_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
}


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


class BodyLimit:
    """ASGI middleware: the request body is read here, bounded in size and in time whatever its framing, and
    handed to the app whole.

    A Content-Length over ``limit`` is refused (413) before anything is read; a chunked body (whose announced
    size would be no bound: ``Content-Length: 2`` with a chunked body of gigabytes) is refused (411); the bytes
    actually received are counted all the same (413 past ``limit``), and a body that has not arrived within
    ``timeout_s`` of the request's start is refused (408), so a slow sender holds a connection for a bounded
    time. At most ``limit`` bytes per request are held, whatever the app does with them.
    """

    def __init__(self, app: Callable, limit: int, timeout_s: float | None = None) -> None:
        self.app, self.limit = app, limit
        self.timeout_s = BODY_TIMEOUT_S if timeout_s is None else timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lengths = {value for name, value in scope["headers"] if name == b"content-length"}
        if any(name == b"transfer-encoding" for name, _ in scope["headers"]):
            return await self._refuse(411, "send the body with a Content-Length: chunked bodies are not accepted",
                                      scope, receive, send)
        if len(lengths) > 1 or any(not value.isdigit() or int(value) > self.limit for value in lengths):
            return await self._refuse(413, f"request body over {self.limit} bytes", scope, receive, send)
        body = bytearray()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                return await self._refuse(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                          scope, receive, send)
            if message["type"] != "http.request":  # the client went away: nobody to answer
                return None
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await self._refuse(413, f"request body over {self.limit} bytes", scope, receive, send)
            if not message.get("more_body", False):
                break
        whole: dict[str, Any] | None = {"type": "http.request", "body": bytes(body), "more_body": False}

        async def replay() -> dict[str, Any]:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # after the body: only a disconnect is left to hear of

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(status: int, text: str, scope: dict, receive: Callable, send: Callable) -> None:
        # Connection: close, so that the server reads no more of a body it refused.
        await PlainTextResponse(text, status, headers={"Connection": "close"})(scope, receive, send)


def create_app(picture: PictureSource) -> Starlette:
    """The dashboard's ASGI app over ``picture``, a cheap thread-safe callable returning a fresh dict.

    Routes: ``/`` the page, ``/static/...`` its files, ``/api/status`` the picture as
    JSON, ``/metrics`` Prometheus text, ``/healthz``.  The endpoints that call
    ``picture`` are plain functions, so Starlette runs them in its thread pool and a
    ``picture()`` that briefly waits on a lock never stalls the event loop.

    Example:
        >>> app = create_app(lambda: {"job": {"name": "demo"}, "tasks": [], "history": []})
    """
    page = (resources.files("tensorfleet.dashboard") / "static" / "index.html").read_bytes()

    def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    def status(request: Request) -> Response:
        return JSONResponse(json_safe(picture()), headers={"Cache-Control": "no-store"})

    def metrics(request: Request) -> Response:
        return Response(render_metrics(picture()), media_type=CONTENT_TYPE)

    def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    return Starlette(routes=[
        Route("/", index),
        Route("/api/status", status),
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        Mount("/static", app=StaticFiles(packages=[("tensorfleet.dashboard", "static")]), name="static"),
    ])


class ThreadServer(uvicorn.Server):
    """uvicorn without signal handling: the main thread (the launcher's, ``serve``'s) owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, IPv4 or IPv6 as ``host`` says."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=128)


def serve_in_thread(config: uvicorn.Config, sock: socket.socket, *, name: str,
                    timeout: float) -> tuple[ThreadServer, threading.Thread, bool]:
    """Serve ``config``'s app on ``sock`` from a daemon thread; return (server, thread, whether it serves)
    once uvicorn serves, its thread died, or ``timeout`` seconds passed (then the caller stops it)."""
    server = ThreadServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        # uvicorn has no "started" event to wait on: poll its flag, and notice a thread that died.
        if not thread.is_alive() or time.monotonic() > deadline:
            return server, thread, False
        time.sleep(0.01)
    return server, thread, True


def wait_for_stop_signal() -> None:
    """Block until Ctrl-C or SIGTERM (from the main thread: a command serving in threads until it is told to
    stop); the previous handlers are back on return."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Waits of a bounded length: the kernel may hand the signal to another thread (gRPC's, the server's),
        # which wakes nobody; Python runs the handler once this thread runs again.
        while not stop.wait(STOP_POLL_S):
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def url_host(host: str) -> str:
    """How a browser on this machine reaches ``host`` (a wildcard address means loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class Dashboard:
    """Serves the dashboard for ``picture`` from a background thread.

    Args:
        picture: returns the fleet's state as a fresh JSON-ready dict; cheap and thread-safe.
        host: the address to bind; loopback by default, since the page has no authentication.
        port: the port; 0 picks a free one (``url`` tells which).

    Example:
        >>> dashboard = Dashboard(monitor.picture).start()
        >>> print(f"dashboard: {dashboard.url}")
        >>> dashboard.stop()
    """

    def __init__(self, picture: PictureSource, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._picture = picture
        self._host = host
        self._port = port
        self._socket: socket.socket | None = None
        self._bound_port: int | None = None
        self._server: ThreadServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://HOST:PORT/`` with the port actually bound; only known once started."""
        if self._bound_port is None:
            raise LaunchError("the dashboard has no URL before start()")
        return f"http://{url_host(self._host)}:{self._bound_port}/"

    def start(self, *, timeout: float = START_TIMEOUT_S) -> Dashboard:
        """Bind, start serving in a daemon thread, and return (self, for chaining) once uvicorn serves.

        Raises:
            OSError: the address cannot be bound (port taken, unknown host).
            LaunchError: already started, or uvicorn did not come up within ``timeout`` seconds.
        """
        if self._thread is not None:
            raise LaunchError("the dashboard is already started")
        self._socket = bind(self._host, self._port)
        self._bound_port = self._socket.getsockname()[1]
        config = uvicorn.Config(
            # log_config=None leaves the launcher's logging alone; uvicorn's own INFO lines would only
            # repeat the URL, so warnings and errors (a ``picture()`` that raised) are all it reports.
            create_app(self._picture), loop="asyncio", http="h11", lifespan="off", log_config=None,
            log_level="warning", access_log=False, timeout_graceful_shutdown=1, timeout_keep_alive=5)
        self._server, self._thread, serving = serve_in_thread(config, self._socket, name="tensorfleet-dashboard",
                                                              timeout=timeout)
        if not serving:
            self.stop()
            raise LaunchError(f"the dashboard did not start serving on {self._host}:{self._bound_port}")
        log.info("dashboard at %s", self.url)
        return self

    def stop(self, *, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop serving and close the port; bounded: open connections are cut after about a second.

        Safe to call twice, or without start().
        """
        server, thread, sock = self._server, self._thread, self._socket
        if server is not None and thread is not None:
            server.should_exit = True
            thread.join(timeout / 2)
            if thread.is_alive():
                server.force_exit = True
                thread.join(timeout / 2)
            if thread.is_alive():
                log.warning("the dashboard thread did not stop within %.1f s; left as a daemon", timeout)
        if sock is not None:
            sock.close()
        self._server, self._thread, self._socket = None, None, None

    def __enter__(self) -> Dashboard:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
