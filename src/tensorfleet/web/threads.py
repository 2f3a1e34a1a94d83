"""A uvicorn server in a background thread of a command whose main thread owns Ctrl-C and SIGTERM (the
launcher, ``tensorfleet dashboard``, ``serve``, ``serve-model``): the socket is bound in the caller's thread
first, so a taken port fails there and port 0's choice is known before the thread starts."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from typing import Iterator

import uvicorn

STOP_POLL_S = 0.2  # how often wait_for_stop_signal looks for a signal that reached another thread


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
