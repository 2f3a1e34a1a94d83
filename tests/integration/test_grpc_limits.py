"""The gRPC port bounds what a stranger can hold before any call proves the token (issue 28, item 6): 20,000
unauthenticated connections used every descriptor of a ps. Now at most MAX_CONNECTIONS are held, a connection
that does not open in time is closed, and the job's own channel is served throughout."""

from __future__ import annotations

import resource
import socket

import psutil
import pytest

from tensorfleet.ps.server import FD_RESERVE, ensure_descriptors
from tensorfleet.testing.fleet import poll
from tensorfleet.wire import auth, rpc
from tensorfleet.wire.rpc import WireOptions

pytestmark = pytest.mark.cluster
TOKEN = auth.new_token()
TASK = "/job:ps/task:0"


def held_by_server(port: int) -> int:
    """Connections of this process whose local end is the server's port (the server's side of each)."""
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_a_flood_of_connections_holds_at_most_the_cap_and_the_job_is_served(monkeypatch):
    monkeypatch.setattr(rpc, "MAX_CONNECTIONS", 20, raising=False)
    monkeypatch.setattr(rpc, "HANDSHAKE_TIMEOUT_S", 1.0, raising=False)
    options = WireOptions(token=TOKEN, tls=None)
    server, port = rpc.start_server("127.0.0.1:0", {"Status": lambda meta, tensors: ({"ok": True}, {})},
                                    task=TASK, options=options)
    ours = rpc.Channel(f"127.0.0.1:{port}", task=TASK, options=options)
    flood: list[socket.socket] = []
    try:
        assert ours.call("Status", timeout=10)[0] == {"ok": True}  # the job's channel, connected first
        for _ in range(200):
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        assert held_by_server(port) <= 20 + 1  # the cap, and ours
        assert ours.call("Status", timeout=10)[0] == {"ok": True}
        # Silent connections are closed once their opening is overdue: a new channel of the job gets in.
        poll(lambda: held_by_server(port) <= 1, 15, "the silent connections to be closed")
        late = rpc.Channel(f"127.0.0.1:{port}", task=TASK, options=options)
        try:
            assert late.call("Status", timeout=10)[0] == {"ok": True}
        finally:
            late.close()
    finally:
        for sock in flood:
            sock.close()
        ours.close()
        server.stop(0)


def test_a_ps_may_hold_what_its_ports_may_hold_and_its_reserve():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        assert ensure_descriptors(TASK) >= min(rpc.MAX_CONNECTIONS + 512 + FD_RESERVE, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= min(rpc.MAX_CONNECTIONS + 512 + FD_RESERVE, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
