"""A ps with no job token refuses to serve on a non-loopback address unless told ``--insecure`` (issue 18, item 4).

Without a token, anyone who can reach a ps can Init it before the chief, force a restore over
every value, Snapshot it or send Done (a remote shutdown). On loopback that is the machine's own
users; on ``0.0.0.0`` or an interface's address it is the network. So, without a token there, the
ps refuses to start and says what to do; with ``insecure`` it starts and warns; with a token, or on
loopback, nothing changes. Real sockets on free ports; the subprocesses are bounded and killed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tensorfleet.cluster.flags import add_cluster_flags, insecure_from_flags
from tensorfleet.cluster.spec import ClusterSpec, is_loopback_host
from tensorfleet.errors import ConfigError, UnavailableError
from tensorfleet.cluster.ports import free_ports
from tensorfleet.launch.task import run_task
from tensorfleet.ps.server import Server
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.wire import auth
from tensorfleet.wire.rpc import Channel, WireOptions

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
PACED_JOB = REPO / "tests" / "integration" / "paced_job.py"
SECURITY_ENV = (auth.TOKEN_ENV, auth.TOKEN_FILE_ENV, "TENSORFLEET_INSECURE")
START_TIMEOUT_S = 90.0  # a fresh interpreter imports torch and grpc on a busy, shared machine
SERVER_LOGGER = "tensorfleet.ps.server"


def interface_address() -> str | None:
    """This machine's address on its default route, if it has one that is not loopback (nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: a UDP connect only picks the route
            host = probe.getsockname()[0]
        except OSError:
            return None
    return None if is_loopback_host(host) or host == "0.0.0.0" else host


def exposed_cluster(host: str) -> tuple[ClusterSpec, int]:
    """A 1-ps, 1-worker cluster named by ``host`` (a ps there listens on every interface); the ps port."""
    try:
        ps_port, worker_port = free_ports(2, "0.0.0.0")
    except OSError as exc:
        pytest.skip(f"cannot bind 0.0.0.0 on this machine ({exc}): no non-loopback address to test")
    if host == "interface":
        found = interface_address()
        if found is None:
            pytest.skip("this machine has no non-loopback interface address (0.0.0.0 is tested anyway)")
        host = found
    return ClusterSpec.from_dict({"ps": [f"{host}:{ps_port}"], "worker": [f"{host}:{worker_port}"]}), ps_port


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def answers_status(port: int, token: str | None = None) -> dict:
    channel = Channel(f"127.0.0.1:{port}", task="/job:ps/task:0", options=WireOptions(token=token))
    try:
        return channel.call("Status", timeout=10)[0]
    finally:
        channel.close()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == SERVER_LOGGER and r.levelno >= logging.WARNING]


@pytest.fixture(autouse=True)
def no_token(monkeypatch):
    """Every test starts with no token and no TENSORFLEET_INSECURE, whatever the shell had."""
    for name in SECURITY_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def started():
    """Servers a test starts, stopped at its end even when it fails."""
    servers: list[Server] = []
    yield servers
    for server in servers:
        server.stop(grace_s=0)


@pytest.mark.parametrize("host", ["0.0.0.0", "interface"])
def test_a_ps_without_a_token_refuses_a_non_loopback_address_and_says_what_to_do(host):
    cluster, port = exposed_cluster(host)
    with pytest.raises(ConfigError) as raised:
        server = Server(cluster, job_name="ps", task_index=0, options=WireOptions(token=None))
        server.stop(grace_s=0)  # today's code starts it: stop it before the test fails
    message = str(raised.value)
    assert "refusing to serve" in message and cluster.ps_addresses[0] in message
    for advice in ("TENSORFLEET_TOKEN", "TENSORFLEET_TOKEN_FILE", "--insecure", "python -m tensorfleet.ps",
                   "TENSORFLEET_INSECURE=1"):
        assert advice in message, advice
    assert port_is_free(port), "a refused ps must leave nothing listening"


def test_an_empty_token_is_no_token():
    cluster, _ = exposed_cluster("0.0.0.0")
    with pytest.raises(ConfigError, match="refusing to serve"):
        Server(cluster, job_name="ps", task_index=0, options=WireOptions(token="")).stop(grace_s=0)


@pytest.mark.parametrize("host", ["0.0.0.0", "interface"])
def test_insecure_starts_it_with_one_warning(host, caplog, started):
    cluster, port = exposed_cluster(host)
    caplog.set_level(logging.INFO, logger=SERVER_LOGGER)
    started.append(Server(cluster, job_name="ps", task_index=0, options=WireOptions(token=None), insecure=True))
    assert answers_status(port)["task"] == "/job:ps/task:0"  # no token asked: it really is insecure
    [warning] = warnings_of(caplog)
    assert "INSECURE" in warning and "anyone who can reach" in warning and cluster.ps_addresses[0] in warning


def test_tensorfleet_insecure_1_starts_it_when_the_caller_says_nothing(monkeypatch, caplog, started):
    cluster, port = exposed_cluster("0.0.0.0")
    monkeypatch.setenv("TENSORFLEET_INSECURE", "1")
    caplog.set_level(logging.INFO, logger=SERVER_LOGGER)
    started.append(Server(cluster, job_name="ps", task_index=0, options=WireOptions(token=None)))
    assert answers_status(port)["task"] == "/job:ps/task:0"
    assert len(warnings_of(caplog)) == 1


def test_insecure_false_wins_over_the_environment_and_a_bad_value_is_named(monkeypatch):
    cluster, _ = exposed_cluster("0.0.0.0")
    monkeypatch.setenv("TENSORFLEET_INSECURE", "1")
    with pytest.raises(ConfigError, match="refusing to serve"):
        Server(cluster, job_name="ps", task_index=0, options=WireOptions(token=None), insecure=False).stop(0)
    monkeypatch.setenv("TENSORFLEET_INSECURE", "maybe")
    with pytest.raises(ConfigError, match="TENSORFLEET_INSECURE='maybe'"):
        Server(cluster, job_name="ps", task_index=0, options=WireOptions(token=None)).stop(0)


def test_with_a_token_it_starts_silently_and_requires_it(caplog, started):
    cluster, port = exposed_cluster("0.0.0.0")
    token = auth.new_token()
    caplog.set_level(logging.INFO, logger=SERVER_LOGGER)
    started.append(Server(cluster, job_name="ps", task_index=0, options=WireOptions(token=token)))
    assert answers_status(port, token)["task"] == "/job:ps/task:0"
    assert warnings_of(caplog) == []


def test_from_the_environment_token_it_starts(monkeypatch, started):
    cluster, port = exposed_cluster("0.0.0.0")
    token = auth.new_token()
    monkeypatch.setenv(auth.TOKEN_ENV, token)  # the default WireOptions reads it
    started.append(Server(cluster, job_name="ps", task_index=0))
    assert answers_status(port, token)["task"] == "/job:ps/task:0"


def test_on_loopback_without_a_token_nothing_changes(caplog):
    caplog.set_level(logging.INFO, logger=SERVER_LOGGER)
    with ps_servers(num_ps=1, num_workers=1, options=WireOptions(token=None)) as (cluster, servers):
        assert answers_status(servers[0].port)["task"] == "/job:ps/task:0"
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "localhost", "::1", "[::1]"])
def test_loopback_hosts(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.0.2.2", "ps-0.ml.svc", "fe80::1"])
def test_non_loopback_hosts(host):
    assert not is_loopback_host(host)


def test_the_insecure_flag_and_its_variable(monkeypatch):
    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    assert parser.parse_args([]).insecure is False
    assert insecure_from_flags(parser.parse_args(["--insecure"]))
    assert not insecure_from_flags(parser.parse_args([]))
    monkeypatch.setenv("TENSORFLEET_INSECURE", "1")
    assert insecure_from_flags(parser.parse_args([]))
    assert insecure_from_flags(argparse.Namespace())  # a parser of its own, without the flag: the variable


def test_run_task_refuses_with_status_2_and_the_message(capsys, monkeypatch):
    cluster, port = exposed_cluster("0.0.0.0")
    # Should a ps start after all, stop it at once instead of serving until a worker is done.
    monkeypatch.setattr(Server, "join", lambda self, *a, **k: self.stop(grace_s=0) or True)
    threads = torch.get_num_threads()
    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    args = parser.parse_args(["--ps_hosts", cluster.ps_addresses[0], "--worker_hosts",
                              cluster.task_address("worker", 0), "--job_name", "ps", "--task_index", "0"])
    try:
        assert run_task(args, lambda *_: pytest.fail("a ps does not train")) == 2
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "error: " in err and "refusing to serve" in err and "--insecure" in err
    assert port_is_free(port)


def test_a_worker_without_a_token_on_a_non_loopback_address_warns_but_trains(caplog):
    cluster, _ = exposed_cluster("0.0.0.0")
    threads = torch.get_num_threads()
    caplog.set_level(logging.INFO)
    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    args = parser.parse_args(["--ps_hosts", cluster.ps_addresses[0], "--worker_hosts",
                              cluster.task_address("worker", 0), "--job_name", "worker", "--task_index", "0"])
    trained = []
    try:
        assert run_task(args, lambda *a: trained.append(a)) == 0
    finally:
        torch.set_num_threads(threads)
    assert len(trained) == 1
    exposed = [r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING and "answers anyone who can reach it" in r.getMessage()]
    assert len(exposed) == 1 and "TENSORFLEET_TOKEN" in exposed[0]


# --- the command lines: `python -m tensorfleet.ps` and a classic script's run_task ---------------------------

def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SECURITY_ENV and k != "TF_CONFIG"
           and not k.startswith("TENSORFLEET_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src")] + [p for p in [env.get("PYTHONPATH")] if p])
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def cluster_flags(cluster: ClusterSpec) -> list[str]:
    return ["--ps_hosts", cluster.ps_addresses[0], "--worker_hosts", cluster.task_address("worker", 0),
            "--job_name", "ps", "--task_index", "0"]


COMMANDS = {"python -m tensorfleet.ps": [sys.executable, "-m", "tensorfleet.ps"],
            "a script's run_task": [sys.executable, str(PACED_JOB)]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_command_line_refuses_with_status_2_and_the_message_on_stderr(command):
    cluster, port = exposed_cluster("0.0.0.0")
    try:
        done = subprocess.run(COMMANDS[command] + cluster_flags(cluster), env=clean_env(), cwd=REPO,
                              capture_output=True, text=True, timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # subprocess.run killed it
        pytest.fail(f"{command} did not refuse: it was still running after {START_TIMEOUT_S} s")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "refusing to serve" in done.stderr and "--insecure" in done.stderr and "TENSORFLEET_TOKEN" in done.stderr
    assert "Traceback" not in done.stderr
    assert port_is_free(port)


@pytest.mark.parametrize("command, how", [("python -m tensorfleet.ps", "flag"), ("a script's run_task", "flag"),
                                          ("a script's run_task", "env")])
def test_the_command_line_with_insecure_serves_and_warns_on_stderr(command, how, tmp_path):
    cluster, port = exposed_cluster("0.0.0.0")
    argv = COMMANDS[command] + cluster_flags(cluster) + (["--insecure"] if how == "flag" else [])
    env = clean_env(**({"TENSORFLEET_INSECURE": "1"} if how == "env" else {}))
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, f"it exited {process.returncode}:\n{stderr_path.read_text()[-3000:]}"
            try:
                assert answers_status(port)["task"] == "/job:ps/task:0"
                break
            except UnavailableError:
                if time.monotonic() > deadline:
                    pytest.fail(f"no Status on port {port} after {START_TIMEOUT_S} s:\n{stderr_path.read_text()}")
                time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
    warnings = [line for line in stderr_path.read_text().splitlines() if "WARNING" in line and "INSECURE" in line]
    assert len(warnings) == 1 and "anyone who can reach this address" in warnings[0], stderr_path.read_text()
