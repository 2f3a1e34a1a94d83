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

import logging
import socket
import threading
from importlib import resources
from types import TracebackType
from typing import Callable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tensorfleet.dashboard.metrics import CONTENT_TYPE, render_metrics
from tensorfleet.dashboard.picture import FleetPicture
from tensorfleet.errors import LaunchError
from tensorfleet.web import ThreadServer, bind, json_safe, serve_in_thread, url_host

__all__ = ["Dashboard", "PictureSource", "create_app"]

# Where the dashboard gets the fleet (``tensorfleet.dashboard.picture``): ``FleetMonitor.picture`` (or a
# test's stand-in); cheap, thread-safe, a fresh picture each call.
PictureSource = Callable[[], FleetPicture]

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0

# The page builds its DOM with textContent only; the policy is the second line of defence
# against a task name that carries markup.  uPlot positions its elements with inline styles.
_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
}


def create_app(picture: PictureSource) -> Starlette:
    """The dashboard's ASGI app over ``picture``, a cheap thread-safe callable returning a fresh picture.

    Routes: ``/`` the page, ``/static/...`` its files, ``/api/status`` the picture as
    JSON, ``/metrics`` Prometheus text, ``/healthz``.  The endpoints that call
    ``picture`` are plain functions, so Starlette runs them in its thread pool and a
    ``picture()`` that briefly waits on a lock never stalls the event loop.

    Example:
        >>> from tensorfleet.dashboard.picture import JobPicture
        >>> app = create_app(lambda: FleetPicture(JobPicture(name="demo")))
    """
    page = (resources.files("tensorfleet.dashboard") / "static" / "index.html").read_bytes()

    def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    def status(request: Request) -> Response:
        return JSONResponse(json_safe(picture().to_json()), headers={"Cache-Control": "no-store"})

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


class Dashboard:
    """Serves the dashboard for ``picture`` from a background thread.

    Args:
        picture: returns the fleet's state as a fresh ``FleetPicture``; cheap and thread-safe.
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
