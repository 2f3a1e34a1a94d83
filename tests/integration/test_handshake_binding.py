"""A data-plane proof is bound to the task it is for and to its direction (issue 28, item 2): a process that took a
dead task's port cannot relay a live task's handshake into an authenticated connection, and a client never proves
itself to a server that failed its check."""

from __future__ import annotations

import socket

import pytest
import torch

from tensorfleet.errors import UnauthenticatedError
from tensorfleet.testing.sockets import Relay
from tensorfleet.wire import auth, frame
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.wire.dataplane import HELLO, OK, PROVE, Reply
from tensorfleet.wire.dataserver import DataServer
from tensorfleet.wire.rpc import WireOptions

pytestmark = pytest.mark.cluster
TOKEN = auth.new_token()
PS0, PS1 = "/job:ps/task:0", "/job:ps/task:1"
OPTIONS = WireOptions(token=TOKEN, tls=None)


@pytest.fixture
def live_ps0():
    """ps:0's data server, whose one method reads what it holds (a stand-in for Pull or Snapshot)."""
    calls: list[str] = []

    def read(request):
        calls.append("read")
        return Reply({"secret": "ps:0's values"}, {"w": torch.ones(2)})

    server = DataServer("127.0.0.1", {"Read": read}, task=PS0, options=OPTIONS)
    yield server, calls
    server.stop()


def test_a_squatter_relaying_a_live_tasks_handshake_gets_no_proof_and_no_connection(live_ps0):
    server, calls = live_ps0
    relay = Relay(("127.0.0.1", server.port))  # the squatter on the dead ps:1's port, piping to the live ps:0
    victim = DataChannel(task=PS1, options=OPTIONS)  # the worker's channel to ps:1, whose port the squatter holds
    victim.set_address("127.0.0.1", relay.port)
    try:
        with pytest.raises(UnauthenticatedError, match=f"did not prove it is {PS1} of this job"):
            victim.call("Read", {})
    finally:
        victim.close()
        relay.close()
    # The victim's Hello crossed the relay before ps:0's answer came back: what it sent is all recorded.
    assert HELLO.encode() in relay.upstream and PROVE.encode() not in relay.upstream  # no proof to relay
    assert calls == []


def handshake(port: int, answer) -> str:
    """Open a raw connection to ``port``, say Hello, send ``answer(client_nonce, server_nonce)`` as the proof;
    return the kind of the server's last reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        client_nonce = auth.new_nonce()
        frame.send_message(raw, HELLO, {"nonce": client_nonce})
        reader = frame.Reader(raw)
        challenge = reader.read_head(max_body_bytes=1 << 20)
        assert challenge.kind == OK
        frame.send_message(raw, PROVE, {"proof": answer(client_nonce, challenge.meta["nonce"])})
        return reader.read_head(max_body_bytes=1 << 20).kind


def test_a_proof_for_another_task_or_the_other_direction_is_refused(live_ps0):
    server, calls = live_ps0
    for_ps1 = lambda c, s: auth.proof(TOKEN, "client", PS1, s, c)  # noqa: E731 - made for ps:1
    as_server = lambda c, s: auth.proof(TOKEN, "server", PS0, s, c)  # noqa: E731 - the other direction's
    right = lambda c, s: auth.proof(TOKEN, "client", PS0, s, c)  # noqa: E731
    assert handshake(server.port, for_ps1) == UnauthenticatedError.code
    assert handshake(server.port, as_server) == UnauthenticatedError.code
    assert handshake(server.port, right) == OK
    assert server.gate.refused == 2 and calls == []
