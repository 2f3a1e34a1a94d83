"""The job token: every gRPC call and every data connection without it is refused, counted, and changes nothing."""

import socket
import time

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import ConfigError, UnauthenticatedError
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.wire import auth, frame
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.wire.dataplane import Reply
from tensorfleet.wire.dataserver import DataServer
from tensorfleet.wire.rpc import Channel, WireOptions
from tensorfleet.worker.client import PsClient

TOKEN = auth.new_token()
VALUES = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


@pytest.fixture
def guarded():
    """One ps that requires TOKEN, initialized by a client that has it."""
    with ps_servers(num_ps=1, num_workers=1, options=WireOptions(token=TOKEN)) as (cluster, servers):
        client = PsClient(cluster, {"w": 0}, options=WireOptions(token=TOKEN))
        client.wait_for_shards(10)
        client.initialize(VALUES, OptimizerSpec.sgd(lr=1.0))
        yield cluster, servers[0], client
        client.close()


@pytest.mark.parametrize("token, refusal, counted", [
    (None, "refuses calls without the job's token", 2),  # the server's word
    ("wrong", "did not prove it is /job:ps/task:0 of this job", 0),  # ours: the task failed our check first
    (TOKEN[:-1], "did not prove it is /job:ps/task:0 of this job", 0)])
def test_grpc_calls_without_the_right_token_are_refused_and_counted(guarded, token, refusal, counted):
    cluster, server, _ = guarded
    stranger = Channel(cluster.ps_addresses[0], task="/job:ps/task:0", options=WireOptions(token=token))
    try:
        with pytest.raises(UnauthenticatedError, match=refusal):
            stranger.call("Init", {"optimizer": {"name": "sgd", "options": {"lr": 9.0}}}, {"w": torch.zeros(2, 3)},
                          timeout=10)
        with pytest.raises(UnauthenticatedError):
            stranger.call("Status", timeout=10)
    finally:
        stranger.close()
    assert server.status()["auth_refused"] == counted  # a proof under another token: tests/integration/test_call_proof
    assert torch.equal(server.store.read()[0]["w"], VALUES["w"])


@pytest.mark.parametrize("token, refusal", [
    (None, "refuses data connections without the job's token"),  # the server's word
    ("wrong", "did not prove it is /job:ps/task:0 of this job")])  # ours: the task failed our check first
def test_data_connections_without_the_right_token_are_refused_closed_and_change_nothing(guarded, token, refusal):
    _, server, client = guarded
    port = client.wait_for_shards(10)[0].data_port
    channel = DataChannel(task="/job:ps/task:0", options=WireOptions(token=token))
    channel.set_address("127.0.0.1", port)
    try:
        with pytest.raises(UnauthenticatedError, match=refusal):
            channel.call("Push", {"advance_step": True}, {"w": torch.ones(2, 3)})
    finally:
        channel.close()
    # A raw connection that skips the Hello gets the refusal and a closed stream.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        frame.send_message(raw, "Pull", {})
        reader = frame.Reader(raw)
        assert reader.read_head(max_body_bytes=1 << 20).kind == UnauthenticatedError.code
        assert raw.recv(1) == b""  # closed
    assert server.status()["auth_refused"] == 2
    assert server.status()["global_step"] == 0 and torch.equal(server.store.read()[0]["w"], VALUES["w"])
    assert client.push({"w": torch.ones(2, 3)}).global_step == 1  # the job's own clients are still served


def test_a_replica_with_the_token_trains_against_a_guarded_ps():
    with ps_servers(num_ps=1, num_workers=1, options=WireOptions(token=TOKEN)) as (cluster, server):
        model = nn.Linear(2, 1)
        with tfl.Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1),
                         wire=WireOptions(token=TOKEN)) as replica:
            model(torch.ones(3, 2)).sum().backward()
            assert replica.push() == 1
        assert server[0].status()["auth_refused"] == 0


def test_the_token_comes_from_the_environment_or_a_file(tmp_path):
    assert auth.job_token({}) is None
    assert auth.job_token({auth.TOKEN_ENV: "abc"}) == "abc"
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    assert auth.job_token({auth.TOKEN_FILE_ENV: str(secret)}) == TOKEN
    with pytest.raises(ConfigError, match="cannot be read"):
        auth.job_token({auth.TOKEN_FILE_ENV: str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        auth.job_token({auth.TOKEN_FILE_ENV: str(tmp_path / "empty")})
    assert "token" not in repr(WireOptions(token=TOKEN)) and TOKEN not in repr(WireOptions(token=TOKEN))


def test_an_admitted_data_connection_may_stay_idle_past_the_deadline():
    """The Hello is bounded by the deadline; once admitted, a connection waits for requests without bound
    (a worker evaluating for minutes between steps keeps its connection)."""
    options = WireOptions(token=TOKEN, deadline_s=0.3)
    server = DataServer("127.0.0.1", {"Echo": lambda r: Reply(r.meta, r.receive())}, task="idle", options=options)
    channel = DataChannel(task="idle", options=options)
    channel.set_address("127.0.0.1", server.port)
    try:
        assert channel.call("Echo", {"n": 1})[0] == {"n": 1}
        time.sleep(0.8)  # idle, well past the deadline
        assert channel.call("Echo", {"n": 2})[0] == {"n": 2}  # the same connection: no reconnection here
    finally:
        channel.close()
        server.stop()
