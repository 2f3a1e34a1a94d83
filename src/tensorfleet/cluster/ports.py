"""Ports of this machine for a job's tasks: free ones to listen on, and which of some are taken now."""

from __future__ import annotations

import socket
from typing import Iterable

from tensorfleet.cluster.spec import ClusterSpec


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that were free a moment ago (bound to port 0, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def taken_ports(ports: Iterable[int], host: str = "127.0.0.1") -> list[int]:
    """The ``ports`` of ``host`` that a task could not listen on now: another process holds them."""
    taken = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # As the tasks' servers do: a port a finished job left in TIME_WAIT is free for them.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                taken.append(port)
    return taken


def local_cluster(num_ps: int, num_workers: int, host: str = "127.0.0.1", *,
                  first_port: int | None = None) -> ClusterSpec:
    """A cluster of ``num_ps`` ps and ``num_workers`` workers on ``host``: free ports, or consecutive ones."""
    count = num_ps + num_workers
    ports = free_ports(count, host) if first_port is None else list(range(first_port, first_port + count))
    return ClusterSpec.from_dict({"ps": [f"{host}:{p}" for p in ports[:num_ps]],
                                  "worker": [f"{host}:{p}" for p in ports[num_ps:]]})
