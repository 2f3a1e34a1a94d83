"""gRPC calls prove the job's token instead of carrying it (issue 18, item 3): what a listener on the path sees
(a call's metadata) opens nothing: not replayed, not after its time window, not for another method, not at another
task (issue 28, item 3), not with another request; a malformed proof is a counted refusal (item 7)."""

from __future__ import annotations

import time

import grpc
import pytest

from tensorfleet.wire import auth, codec, rpc
from tensorfleet.wire.rpc import SERVICE, WireOptions

TOKEN = "the-job-token"
STATUS = f"/{SERVICE}/Status"
INIT = f"/{SERVICE}/Init"
PS0, PS1 = "/job:ps/task:0", "/job:ps/task:1"
EMPTY = codec.encode({}, {})
pytestmark = pytest.mark.cluster


@pytest.fixture
def served():
    gate = auth.Gate(TOKEN, PS0)
    server, port = rpc.start_server("127.0.0.1:0", {"Status": lambda meta, tensors: ({"ok": True}, {}),
                                                    "Init": lambda meta, tensors: ({"forced": meta}, {})},
                                    task=PS0, options=WireOptions(token=TOKEN, tls=None), gate=gate)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, gate, port
    channel.close()
    server.stop(0)


def made(gate: auth.Gate, method: str = STATUS, task: str = PS0, request: bytes = EMPTY, token: str = TOKEN,
         **kwargs) -> str:
    """A proof as the job's channel makes it for a call to ``task`` (in the gate's incarnation)."""
    return auth.call_proof(token, method, task, request, incarnation=gate.incarnation, **kwargs)


def call(channel: grpc.Channel, method: str, presented: str | None, request: bytes = EMPTY) -> grpc.StatusCode:
    metadata = ((auth.METADATA_KEY, presented),) if presented is not None else None
    try:
        channel.unary_unary(method)(request, timeout=10, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_the_job_s_own_channel_is_served_and_sends_no_token(served):
    _, gate, port = served
    channel = rpc.Channel(f"127.0.0.1:{port}", task=PS0, options=WireOptions(token=TOKEN, tls=None))
    try:
        assert channel.call("Status")[0] == {"ok": True}
        assert channel.call("Status")[0] == {"ok": True}  # a fresh proof each call
    finally:
        channel.close()
    assert gate.refused == 0


def test_what_a_listener_could_copy_opens_nothing(served):
    channel, gate, _ = served
    assert call(channel, STATUS, TOKEN) == grpc.StatusCode.UNAUTHENTICATED  # the raw token: the old way
    seen = made(gate)
    assert call(channel, STATUS, seen) == grpc.StatusCode.OK
    assert call(channel, STATUS, seen) == grpc.StatusCode.UNAUTHENTICATED  # the same proof again: a replay
    assert call(channel, f"/{SERVICE}/Done", made(gate)) == grpc.StatusCode.UNAUTHENTICATED
    stale = made(gate, now=time.time() - auth.CALL_WINDOW_S - 60)
    assert call(channel, STATUS, stale) == grpc.StatusCode.UNAUTHENTICATED
    assert call(channel, STATUS, made(gate, token="another-token")) == grpc.StatusCode.UNAUTHENTICATED
    assert call(channel, STATUS, "1.2.3") == grpc.StatusCode.UNAUTHENTICATED
    assert gate.refused == 6


def test_a_proof_made_for_another_task_opens_nothing_here(served):
    """A passive relay in front of ps:1 copies the chief's proofs and replays them at ps:0: refused."""
    channel, gate, _ = served
    for_ps1 = made(gate, task=PS1)
    assert call(channel, STATUS, for_ps1) == grpc.StatusCode.UNAUTHENTICATED
    assert call(channel, STATUS, made(gate)) == grpc.StatusCode.OK
    assert gate.refused == 1


def test_a_proof_copied_onto_another_request_opens_nothing(served):
    """A relay that holds a fresh proof of an Init cannot send another Init (say, one that forces values) with it."""
    channel, gate, _ = served
    asked = codec.encode({"force": False}, {})
    forced = codec.encode({"force": True}, {})
    assert call(channel, INIT, made(gate, INIT, request=asked), forced) == grpc.StatusCode.UNAUTHENTICATED
    assert call(channel, INIT, made(gate, INIT, request=asked), asked) == grpc.StatusCode.OK
    assert gate.refused == 1


TAIL = "." + "0" * 32 + "." + "0" * 32 + "." + "0" * 64 + "." + "0" * 64  # nonce, incarnation, digest and HMAC


@pytest.mark.parametrize("presented", ["\u00b2" * 3 + TAIL, "\u0661\u0662" + TAIL, "1" * 40 + TAIL, "-5" + TAIL,
                                       "1.2.3.4", "...", "", None, 7])
def test_a_malformed_proof_is_refused_by_the_gate_without_raising(presented):
    """'²'.isdigit() is True and int('²') raises: a proof is parsed strictly (gRPC's own client will not even
    send a header that is not ASCII, but what arrives is a stranger's)."""
    gate = auth.Gate(TOKEN, PS0)
    assert gate.admits_call(presented, STATUS) is False
    assert gate.refused == 1


@pytest.mark.parametrize("presented", ["1" * 40 + TAIL, "12" + TAIL.replace("0", "g", 1), "1.2.3.4", "...", "",
                                       "x" * 5000])
def test_a_malformed_proof_is_a_counted_refusal_not_an_error(served, presented, caplog):
    channel, gate, _ = served
    assert call(channel, STATUS, presented) == grpc.StatusCode.UNAUTHENTICATED
    assert gate.refused == 1
    assert not [r for r in caplog.records if r.exc_info]  # no traceback logged for it
    assert call(channel, STATUS, made(gate)) == grpc.StatusCode.OK
