"""gRPC calls prove the job's token instead of carrying it (issue 18, item 3): what a listener on the path sees
(a call's metadata) opens nothing: not replayed, not after its time window, not for another method."""

from __future__ import annotations

import time

import grpc
import pytest

from tensorfleet.wire import auth, codec, rpc
from tensorfleet.wire.rpc import SERVICE, WireOptions

TOKEN = "the-job-token"
STATUS = f"/{SERVICE}/Status"
pytestmark = pytest.mark.cluster


@pytest.fixture
def served():
    gate = auth.Gate(TOKEN)
    server, port = rpc.start_server("127.0.0.1:0", {"Status": lambda meta, tensors: ({"ok": True}, {})},
                                    task="ps:0", options=WireOptions(token=TOKEN, tls=None), gate=gate)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, gate, port
    channel.close()
    server.stop(0)


def call(channel: grpc.Channel, method: str, presented: str | None) -> grpc.StatusCode:
    metadata = ((auth.METADATA_KEY, presented),) if presented is not None else None
    try:
        channel.unary_unary(method)(codec.encode({}, {}), timeout=10, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_the_job_s_own_channel_is_served_and_sends_no_token(served):
    _, gate, port = served
    channel = rpc.Channel(f"127.0.0.1:{port}", task="ps:0", options=WireOptions(token=TOKEN, tls=None))
    try:
        assert channel.call("Status")[0] == {"ok": True}
        assert channel.call("Status")[0] == {"ok": True}  # a fresh proof each call
    finally:
        channel.close()
    assert gate.refused == 0


def test_what_a_listener_could_copy_opens_nothing(served):
    channel, gate, _ = served
    assert call(channel, STATUS, TOKEN) == grpc.StatusCode.UNAUTHENTICATED  # the raw token: the old way
    seen = auth.call_proof(TOKEN, STATUS)
    assert call(channel, STATUS, seen) == grpc.StatusCode.OK
    assert call(channel, STATUS, seen) == grpc.StatusCode.UNAUTHENTICATED  # the same proof again: a replay
    assert call(channel, f"/{SERVICE}/Done", auth.call_proof(TOKEN, STATUS)) == grpc.StatusCode.UNAUTHENTICATED
    stale = auth.call_proof(TOKEN, STATUS, now=time.time() - auth.CALL_WINDOW_S - 60)
    assert call(channel, STATUS, stale) == grpc.StatusCode.UNAUTHENTICATED
    assert call(channel, STATUS, auth.call_proof("another-token", STATUS)) == grpc.StatusCode.UNAUTHENTICATED
    assert call(channel, STATUS, "1.2.3") == grpc.StatusCode.UNAUTHENTICATED
    assert gate.refused == 6
