"""What tests ask of a raw socket to a task."""

from __future__ import annotations

import socket
import threading
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


class Relay:
    """A TCP relay in front of a server that records every byte crossing it, each way: what a listener on
    the path sees, or a process that took a dead task's port and pipes its callers to a live one."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.upstream, self.downstream = bytearray(), bytearray()  # client -> server, server -> client
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            for source, sink, record in ((client, server, self.upstream), (server, client, self.downstream)):
                threading.Thread(target=self._pump, args=(source, sink, record), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, record: bytearray) -> None:
        try:
            while data := source.recv(1 << 16):
                with self._lock:
                    record += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            sock.close()
