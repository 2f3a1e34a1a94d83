"""What tests ask of a raw socket to a task."""

from __future__ import annotations

import socket
import time


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """The server closed ``sock`` (end of stream or reset) within ``seconds``; bytes before that are skipped."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return True
        except socket.timeout:
            continue
        except OSError:
            return True
    return False
