"""A model's second layer placed on another process (``tensorfleet.coordinator.placement``): torch RPC, distributed
autograd and DistributedOptimizer over a tensorfleet cluster on 127.0.0.1. This process is the chief; two worker
processes serve. Training across the processes must give, to float rounding, what the same model trained here
gives: the forward crosses to worker 1 and back, and so does the backward (the first layer, here, only learns
right from the gradient worker 1 sends back)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.coordinator import placement
from tensorfleet.coordinator.placement import PlacedModule, RpcGroup, place_module
from tensorfleet.errors import ConfigError, InvalidArgumentError
from tensorfleet.launch.local import free_ports
from tensorfleet.testing.fleet import poll

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

STEPS, BATCH, IN, HIDDEN, OUT = 8, 16, 20, 12, 4
START_S = 60.0  # every wait below is bounded; a start on a loaded 2-core machine takes seconds

WORKER = """
import sys
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.coordinator.placement import RpcGroup
cluster = ClusterSpec.from_dict({cluster!r})
with RpcGroup(cluster, TaskSpec("worker", {index}), start_timeout_s={start_s}):
    pass  # a worker serves the chief's calls until the chief leaves its block
print("worker {index} left the group", flush=True)
"""


# The workers are told to listen on another interface (eth0, say) where the machine has one: a loopback group holds
# TensorPipe and Gloo to the loopback interface whatever the environment says (test_everything_listens_on_loopback).
OTHER_INTERFACES = [name for _, name in socket.if_nameindex() if not name.startswith("lo")]
ELSEWHERE = {"TP_SOCKET_IFNAME": OTHER_INTERFACES[0], "GLOO_SOCKET_IFNAME": OTHER_INTERFACES[0]} if OTHER_INTERFACES else {}


def start_worker(cluster: ClusterSpec, index: int) -> subprocess.Popen:
    code = WORKER.format(cluster=cluster.as_dict(), index=index, start_s=START_S)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **ELSEWHERE})


def stop(processes: list[subprocess.Popen]) -> list[str]:
    """Wait a little for each to leave, kill what did not; their output, for failure messages."""
    outputs = []
    for process in processes:
        try:
            out, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
        outputs.append(out)
    return outputs


@pytest.fixture(scope="module")
def group(keep_processes):
    """The chief (this process) and workers 0 and 1, in one RPC group for the module's tests."""
    ports = free_ports(3)
    cluster = ClusterSpec.from_dict({"chief": [f"127.0.0.1:{ports[0]}"],
                                     "worker": [f"127.0.0.1:{p}" for p in ports[1:]]})
    workers = [start_worker(cluster, index) for index in range(2)]
    keep_processes.keep(p.pid for p in workers)
    try:
        with RpcGroup(cluster, TaskSpec("chief", 0), start_timeout_s=START_S) as chief:
            yield chief, workers
        outputs = stop(workers)
        for index, (process, out) in enumerate(zip(workers, outputs)):
            assert process.returncode == 0 and f"worker {index} left the group" in out, out[-3000:]
    finally:
        stop(workers)
        keep_processes.release(p.pid for p in workers)


class Mlp(nn.Module):
    """The seed MLP's shape, small: the hidden layer here, the output layer on ``out_device`` (None: here)."""

    def __init__(self, out_device: str | None) -> None:
        super().__init__()
        self.hidden = nn.Linear(IN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT) if out_device is None else place_module(out_device, nn.Linear, HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=generator), torch.randint(0, OUT, (BATCH,), generator=generator)


OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), "adam": (torch.optim.Adam, {"lr": 0.01})}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_placed_layer_trains_as_the_local_model(group, name):
    optimizer_class, settings = OPTIMIZERS[name]
    torch.manual_seed(0)
    local = Mlp(None)
    placed = Mlp("/job:worker/task:1/device:CPU:0")
    initial = {key: value.clone() for key, value in local.state_dict().items()}
    placed.load_state_dict(initial)  # the same start: the output layer's values sent to worker 1
    assert isinstance(placed.out, PlacedModule)
    assert {rref.owner().name for rref in placed.out.remote_parameters()} == {"worker:1"}
    assert [p.shape for p in placed.parameters()] == [p.shape for p in local.hidden.parameters()]

    reference = optimizer_class(local.parameters(), **settings)
    distributed = placement.distributed_optimizer(optimizer_class, placed, **settings)
    for step in range(STEPS):
        images, labels = batch(step)
        reference.zero_grad()
        expected = nn.functional.cross_entropy(local(images), labels)
        expected.backward()
        reference.step()
        loss = placement.train_step(lambda: nn.functional.cross_entropy(placed(images), labels), distributed)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7, msg=f"loss at step {step}")

    trained, wanted = placed.state_dict(), local.state_dict()  # the output layer's read back from worker 1
    assert list(trained) == list(wanted)
    for key in wanted:
        assert not torch.equal(trained[key], initial[key]), f"{key} did not train"
        torch.testing.assert_close(trained[key], wanted[key], rtol=1e-6, atol=1e-7, msg=key)


def test_placed_module_evaluates_and_names_its_device(group):
    model = Mlp("/job:worker/task:0/cpu:0")
    assert "PlacedModule(on /job:worker/replica:0/task:0/device:CPU:0)" in repr(model)
    model.eval()
    with torch.no_grad():
        assert model(batch(0)[0]).shape == (BATCH, OUT)
    here = place_module("/job:chief/task:0/cpu:0", nn.Linear, 3, 2)  # this task: a plain local module
    assert type(here) is nn.Linear


@pytest.mark.parametrize("device, words", [
    ("/job:worker/task:1/tpu:0", "cannot parse device name"),
    ("/job:worker/cpu:0", "names a job but no task"),
    ("/task:1/cpu:0", "names a task but no job"),
    ("/job:worker/task:2/cpu:0", "/job:worker/task:2 is not a member of the RPC group"),
    ("/job:ps/task:0/cpu:0", "/job:ps/task:0 is not a member of the RPC group"),
    ("/job:worker/task:1/device:GPU:99", "on /job:worker/task:1"),
])
def test_a_wrong_device_says_what_is_wrong(group, device, words):
    with pytest.raises(InvalidArgumentError, match=words.replace("/", ".")):
        place_module(device, nn.Linear, 3, 2)


def test_a_module_the_worker_cannot_import_is_refused_before_sending(group):
    with pytest.raises(InvalidArgumentError, match="module-level function"):
        place_module("/job:worker/task:1/cpu:0", lambda: nn.Linear(3, 2))


def _listening(pid: int) -> list[tuple[str, int]]:
    """(host, port) of every TCP socket process ``pid`` listens on (Linux)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                found.append((_host(address), int(port, 16)))
    return found


def _host(hex_address: str) -> str:
    """/proc/net/tcp's address (32-bit words in host order, little-endian here) as text; v4-mapped as v4."""
    raw = bytes.fromhex(hex_address)
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(packed) == 4:
        return str(ipaddress.IPv4Address(packed))
    address = ipaddress.IPv6Address(packed)
    return str(address.ipv4_mapped or address)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_everything_listens_on_loopback_only(group):
    chief, workers = group
    for process in workers:
        listening = _listening(process.pid)
        assert listening, "a worker's TensorPipe agent listens somewhere"
        assert all(host == "127.0.0.1" for host, _ in listening), listening
    host, port = chief.address
    assert [h for h, p in _listening(os.getpid()) if p == port] == ["127.0.0.1"]  # the rendezvous


def test_non_loopback_addresses_are_refused_unless_the_caller_opts_in(monkeypatch):
    monkeypatch.delenv("TENSORFLEET_INSECURE", raising=False)
    cluster = ClusterSpec.from_dict({"chief": ["10.1.2.3:2222"], "worker": ["10.1.2.4:2222"]})
    with pytest.raises(ConfigError, match="arbitrary code execution") as raised:
        RpcGroup(cluster, TaskSpec("chief", 0))
    assert "insecure=True" in str(raised.value) and "10.1.2.4:2222" in str(raised.value)
    RpcGroup(cluster, TaskSpec("chief", 0), insecure=True)  # checked, not started
    monkeypatch.setenv("TENSORFLEET_INSECURE", "1")
    RpcGroup(cluster, TaskSpec("worker", 0))


def test_rendezvous_port_and_membership():
    cluster = ClusterSpec.from_dict({"ps": ["127.0.0.1:2222"], "chief": ["127.0.0.1:2225"],
                                     "worker": ["127.0.0.1:2223", "127.0.0.1:2224"]})
    assert placement.rendezvous_address(cluster, environ={}) == ("127.0.0.1", 2226)
    assert placement.rendezvous_address(cluster, environ={"TENSORFLEET_RPC_PORT": "3000"}) == ("127.0.0.1", 3000)
    assert placement.rendezvous_address(cluster, 4000, environ={"TENSORFLEET_RPC_PORT": "3000"})[1] == 4000
    with pytest.raises(ConfigError, match="TENSORFLEET_RPC_PORT"):
        placement.rendezvous_address(cluster, environ={"TENSORFLEET_RPC_PORT": "http"})
    group = RpcGroup(cluster, TaskSpec("worker", 1))
    assert (group.name, group.rank, group.world_size, group.chief_name) == ("worker:1", 2, 3, "chief:0")
    with pytest.raises(ConfigError, match="takes no part"):
        RpcGroup(cluster, TaskSpec("ps", 0))


def test_a_worker_without_its_chief_gives_up_in_time():
    """No chief ever starts: the worker's wait ends at its deadline, naming what it waited for."""
    ports = free_ports(2)
    cluster = ClusterSpec.from_dict({"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    code = ("from tensorfleet.cluster.spec import ClusterSpec, TaskSpec\n"
            "from tensorfleet.coordinator.placement import RpcGroup\n"
            f"RpcGroup(ClusterSpec.from_dict({cluster.as_dict()!r}), TaskSpec('worker', 0), "
            "start_timeout_s=1).start()\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "DeadlineExceededError: worker:0: waited 1 s for the chief (chief:0)" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - started < 30


PLACED_JOB = '''
import argparse, sys
import torch
from torch import nn
import tensorfleet as tfl
from tensorfleet.coordinator.placement import distributed_optimizer, place_module, run_placed, train_step


def drive(group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), place_module("/job:worker/task:0/cpu:0", nn.Linear, 8, 2))
    optimizer = distributed_optimizer(torch.optim.SGD, model, lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    losses = [float(train_step(lambda: nn.functional.cross_entropy(model(x), y), optimizer)) for _ in range(20)]
    print(f"placed job: loss {losses[0]:.3f} -> {losses[-1]:.3f} on", group.name, flush=True)


parser = argparse.ArgumentParser()
tfl.add_cluster_flags(parser)
sys.exit(run_placed(parser.parse_args(), drive))
'''


def test_run_placed_under_the_launcher(tmp_path):
    """``tensorfleet launch --coordinator``: the chief drives, worker 0 holds the placed layer, the ps exits."""
    script = tmp_path / "placed_job.py"
    script.write_text(PLACED_JOB)
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "launch", "--coordinator", "--ps", "1",
                           "--workers", "1", "--logdir", str(tmp_path / "logs"), str(script)],
                          capture_output=True, text=True, timeout=90)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    losses = re.search(r"placed job: loss ([\d.]+) -> ([\d.]+) on chief:0", output)
    assert losses is not None and float(losses[2]) < float(losses[1]), output[-3000:]
    assert "placed Linear on /job:worker/replica:0/task:0/device:CPU:0" in output
    assert "global step 20" in output, output[-3000:]  # the chief's steps, through its Status (issue 44)


MEMBER = """
import sys, time
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.coordinator.placement import RpcGroup
with RpcGroup(ClusterSpec.from_dict({cluster!r}), TaskSpec(sys.argv[1], 0), start_timeout_s={start_s}) as group:
    print("joined", flush=True)
    if group.is_chief:
        time.sleep(600)  # until SIGKILLed
"""


def test_a_worker_whose_chief_dies_leaves_in_seconds():
    """The chief is SIGKILLed while its worker serves: the worker's check finds it gone, and it exits with an
    error instead of waiting for a release that will never come."""
    ports = free_ports(2)
    cluster = ClusterSpec.from_dict({"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    code = MEMBER.format(cluster=cluster.as_dict(), start_s=START_S)
    members = [subprocess.Popen([sys.executable, "-c", code, role], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for role in ("chief", "worker")]
    try:
        for member in members:
            assert member.stdout.readline().strip() == "joined"
        members[0].kill()
        killed = time.monotonic()
        _, err = members[1].communicate(timeout=60)
        assert members[1].returncode != 0
        assert "ChiefLeftError: worker:0: the chief (chief:0) does not answer any more" in err, err[-2000:]
        assert time.monotonic() - killed < placement.ALIVE_EVERY_S + 20
    finally:
        stop(members)


def test_the_placed_seed_example_trains_with_its_output_layer_on_worker_0(tmp_path):
    """examples/mnist_placed.py, briefly, under the launcher: the seed model learns with its output layer in
    worker 0's process."""
    from tensorfleet.testing.local_cluster import REPO

    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "launch", "--coordinator", "--ps", "1",
                           "--workers", "1", "--logdir", str(tmp_path / "logs"),
                           str(REPO / "examples" / "mnist_placed.py"), "--", "--train_steps", "300"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "output layer on worker:0" in output, output[-3000:]
    assert float(re.search(r"\[chief:0\] test accuracy: ([\d.]+)", output).group(1)) > 0.8, output[-3000:]


# --- a placed job's failures (issue 44) ---------------------------------------------------------------------

PLACED_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mnist_placed.py"
NOISE = ("UserWarning", "DeprecationWarning", "tensorpipe_agent.cpp", "Leaking RRef")


def placed_launch(tmp_path, *script_args: str):
    from tensorfleet.testing.local_cluster import LauncherProcess

    return LauncherProcess(tmp_path / "logs", ["--coordinator", "--ps", "1", "--workers", "1", "--progress-every", "1"],
                           PLACED_EXAMPLE, script_args)


def test_a_configuration_error_of_the_placed_chief_ends_the_job_at_once_saying_why(tmp_path):
    """A device worker 0 lacks: the chief exits 2 with the error as its last line, the launcher does not start it
    again (no 120 s wait for a worker that already left), and the worker is stopped, not "done"."""
    run = placed_launch(tmp_path, "--train_steps", "300", "--device", "/job:worker/task:0/device:GPU:99")
    began = time.monotonic()
    try:
        code, output = run.wait(timeout_s=90)
    finally:
        run.kill()
    assert code == 1, output
    assert time.monotonic() - began < 60, output
    chief = [line for line in output.splitlines() if line.startswith("[chief:0] ")]
    assert chief[-1].startswith("[chief:0] mnist_placed.py: error: cannot place on '/device:GPU:99'"), output
    assert "chief:0 failed: exit code 2; not restarted because exit code 2 means bad flags" in output, output
    assert "restarting" not in output, output
    assert (run.logdir / "chief-0.log").read_text().splitlines()[-1] == chief[-1].removeprefix("[chief:0] ")
    states = {e["task"]: e for e in run.events() if e["event"] in ("exited", "failed", "stopped")}
    assert states["chief:0"]["event"] == "failed" and states["chief:0"]["code"] == 2, states
    assert states["worker:0"]["event"] == "stopped", states  # it waited for its chief; it never said "done"


def test_a_crashed_placed_chief_resumes_from_its_checkpoint_with_the_worker_that_waited(tmp_path):
    """The chief SIGKILLed mid-run (as by a std::bad_alloc): worker 0 does not exit "done" but waits for it, the
    launcher starts the chief again, it finds the worker and resumes from its checkpoint, and the summary's global
    step is the real one. torch's warnings and TensorPipe's lines stay in the logs."""
    run = placed_launch(tmp_path, "--train_steps", "1500", "--save_checkpoint_steps", "300")
    checkpoint = run.logdir / "checkpoints" / "placed.safetensors"
    try:
        poll(checkpoint.exists, 120, "the chief's first checkpoint")
        chief = run.events_of("chief:0", "started")[0]["pid"]
        os.kill(chief, signal.SIGKILL)
        code, output = run.wait(timeout_s=240)
    finally:
        run.kill()
    assert code == 0, output
    assert "chief:0 killed by SIGKILL; restarting" in output, output
    resumed = int(re.search(r"\[chief:0\] resuming from the checkpoint of step (\d+)", output).group(1))
    assert resumed >= 300 and resumed % 300 == 0, output
    assert "global step 1500" in output and "1 restart," in output, output
    assert [e["task"] for e in run.events() if e["event"] == "started"].count("worker:0") == 1, run.events()
    worker_log = (run.logdir / "worker-0.log").read_text()
    assert re.search(r"worker:0: the chief \(chief:0\) does not answer any more: .*; waiting up to 120 s for it to "
                     r"come back \(restarted\) at the RPC rendezvous 127\.0\.0\.1:\d+", worker_log), worker_log
    assert worker_log.count("worker:0 joined the torch RPC group") == 2, worker_log
    assert float(re.search(r"\[chief:0\] test accuracy: ([\d.]+)", output).group(1)) > 0.9, output
    final = json.loads((run.logdir / "chief-0.status.json").read_text())
    assert final["global_step"] == 1500 and final["state"] == "done", final
    assert not [line for line in output.splitlines() if any(word in line for word in NOISE)], output
    assert "tensorpipe_agent.cpp" in worker_log  # kept, where they belong


WAITING_MEMBER = '''
import argparse, sys, time
import tensorfleet as tfl
from tensorfleet.coordinator.placement import run_placed


def drive(group):
    print("driving", flush=True)
    time.sleep(600)  # until SIGKILLed


parser = argparse.ArgumentParser()
tfl.add_cluster_flags(parser)
sys.exit(run_placed(parser.parse_args(), drive, start_timeout_s={timeout_s}))
'''


def test_a_worker_waits_a_bounded_time_for_its_chief_to_come_back_saying_so(tmp_path):
    """By hand, no launcher to restart the chief: the worker waits ``start_timeout_s`` for it (as a new image of
    its process, same pid), then exits 1 saying what it waited for."""
    ports = free_ports(2)
    tf_config = {"cluster": {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}}
    script = tmp_path / "member.py"
    script.write_text(WAITING_MEMBER.format(timeout_s=8))
    members = {}
    for role in ("chief", "worker"):
        env = {**os.environ, "TF_CONFIG": json.dumps({**tf_config, "task": {"type": role, "index": 0}})}
        members[role] = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True)
    try:
        while members["chief"].stdout.readline().strip() != "driving":  # bounded by the test's timeout
            assert members["chief"].poll() is None, "the chief exited before it drove"
        members["chief"].kill()
        out, _ = members["worker"].communicate(timeout=90)
    finally:
        stop(list(members.values()))
    assert members["worker"].returncode == 1, out
    assert "waiting up to 8 s for it to come back" in out, out
    assert re.search(r"^member\.py: error: worker:0: waited 8 s for the chief \(chief:0\) to come back at the RPC "
                     r"rendezvous 127\.0\.0\.1:\d+ \(it left: worker:0: the chief \(chief:0\) does not answer any more",
                     out.splitlines()[-1]), out
