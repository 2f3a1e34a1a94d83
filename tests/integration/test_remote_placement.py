"""A model's parts placed on other processes (``tensorfleet.coordinator.placement``) over the job's own
authenticated wire, on a tensorfleet cluster on 127.0.0.1. This process is the chief; two worker processes serve.
Training across the processes must give, bit for bit, what the same model trained here gives: the forward crosses
to worker 1 and back, and so does the backward (the first layer, here, only learns right from the gradient worker 1
sends back). A process without the job's token (what another account has) makes no member build or run anything,
and stray bytes at every port a member listens on crash none of them."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.coordinator import placement
from tensorfleet.coordinator.placement import PlacedModule, RpcGroup, place_module, placeable
from tensorfleet.errors import ConfigError, InvalidArgumentError
from tensorfleet.cluster.ports import free_ports
from tensorfleet.testing.fleet import poll
from tensorfleet.wire.rpc import Channel, WireOptions

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

STEPS, BATCH, IN, HIDDEN, OUT = 8, 16, 20, 12, 4
START_S = 60.0  # every wait below is bounded; a start on a loaded 2-core machine takes seconds
TOKEN = "placement-test-token-" + "7" * 20
# The members whose chief dies below hold its lease for this long instead of placegroup.LEASE_S (15 s): the lapse
# is what they wait out. Still well above the chief's renewals (every ALIVE_EVERY_S, 2 s).
TEST_LEASE_S = 6.0
PLACEMENT_METHODS = ("Join", "Place", "Forward", "Backward", "Optimizer", "Step", "State", "LoadState", "Done")

WORKER = """
import sys
import tensorfleet as tfl
from torch import nn
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.coordinator.placement import RpcGroup


@tfl.placeable
def two_layers(width, *, out=2):  # the test module's, by the same name: every task runs the same script
    return nn.Sequential(nn.Linear(width, 6), nn.Tanh(), nn.Linear(6, out))


cluster = ClusterSpec.from_dict({cluster!r})
with RpcGroup(cluster, TaskSpec("worker", {index}), start_timeout_s={start_s}) as group:
    pass  # a worker serves the chief's calls until the chief leaves its block
print("worker {index} left the group", flush=True)
"""


@placeable
def two_layers(width: int, *, out: int = 2) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 6), nn.Tanh(), nn.Linear(6, out))


def start_worker(cluster: ClusterSpec, index: int) -> subprocess.Popen:
    code = WORKER.format(cluster=cluster.as_dict(), index=index, start_s=START_S)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "TENSORFLEET_TOKEN": TOKEN})


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
    """The chief (this process) and workers 0 and 1, in one group for the module's tests, with a job token."""
    ports = free_ports(3)
    cluster = ClusterSpec.from_dict({"chief": [f"127.0.0.1:{ports[0]}"],
                                     "worker": [f"127.0.0.1:{p}" for p in ports[1:]]})
    workers = [start_worker(cluster, index) for index in range(2)]
    keep_processes.keep(p.pid for p in workers)
    try:
        with RpcGroup(cluster, TaskSpec("chief", 0), start_timeout_s=START_S,
                      options=WireOptions(token=TOKEN, tls=None)) as chief:
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


def trains_alike(local: nn.Module, placed: nn.Module, optimizer_class: type, settings: dict) -> None:
    """``placed`` (started from ``local``'s values) trains bit for bit as ``local``."""
    initial = {key: value.clone() for key, value in local.state_dict().items()}
    placed.load_state_dict(initial)  # the same start: the placed parts' values sent to their workers
    reference = optimizer_class(local.parameters(), **settings)
    distributed = placement.distributed_optimizer(optimizer_class, placed, **settings)
    for step in range(STEPS):
        images, labels = batch(step)
        reference.zero_grad()
        expected = nn.functional.cross_entropy(local(images), labels)
        expected.backward()
        reference.step()
        loss = placement.train_step(lambda: nn.functional.cross_entropy(placed(images), labels), distributed)
        assert torch.equal(loss, expected.detach()), f"loss at step {step}: {loss} != {expected}"
    trained, wanted = placed.state_dict(), local.state_dict()  # the placed parts' read back from their workers
    assert list(trained) == list(wanted)
    for key in wanted:
        assert not torch.equal(trained[key], initial[key]), f"{key} did not train"
        assert torch.equal(trained[key], wanted[key]), key


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_placed_layer_trains_as_the_local_model(group, name):
    optimizer_class, settings = OPTIMIZERS[name]
    torch.manual_seed(0)
    local = Mlp(None)
    placed = Mlp("/job:worker/task:1/device:CPU:0")
    assert isinstance(placed.out, PlacedModule) and placed.out.owner == "worker:1"
    assert [p.shape for p in placed.parameters()] == [p.shape for p in local.hidden.parameters()]
    trains_alike(local, placed, optimizer_class, settings)


def test_a_placed_first_part_built_by_a_registered_constructor_trains_as_the_local_model(group):
    """The script's own constructor (``@tfl.placeable``), with keyword arguments, as the model's first part: its
    input needs no gradient, yet its parameters learn."""
    torch.manual_seed(1)
    local = nn.Sequential(two_layers(IN, out=HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    placed = nn.Sequential(place_module("/job:worker/task:0/cpu:0", two_layers, IN, out=HIDDEN), nn.ReLU(),
                           nn.Linear(HIDDEN, OUT))
    assert placed[0].constructor == "two_layers"
    trains_alike(local, placed, torch.optim.SGD, {"lr": 0.05})


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
    ("/job:worker/task:2/cpu:0", "/job:worker/task:2 is not a member of the group"),
    ("/job:ps/task:0/cpu:0", "/job:ps/task:0 is not a member of the group"),
    ("/job:worker/task:1/device:GPU:99", "on /job:worker/task:1"),
])
def test_a_wrong_device_says_what_is_wrong(group, device, words):
    with pytest.raises(InvalidArgumentError, match=words.replace("/", ".")):
        place_module(device, nn.Linear, 3, 2)


class Unregistered(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_what_a_worker_would_not_build_is_refused_before_sending_saying_what_to_do(group):
    where = "/job:worker/task:1/cpu:0"
    for constructor in (lambda: nn.Linear(3, 2), Unregistered, print):
        with pytest.raises(InvalidArgumentError, match="mark it @tfl.placeable at the top level of the script"):
            place_module(where, constructor)
    for argument in (object(), torch.ones(2), float("nan"), nn.Linear):
        with pytest.raises(InvalidArgumentError, match="travel as JSON"):
            place_module(where, nn.Linear, 3, argument)
    with pytest.raises(InvalidArgumentError, match="torch.optim optimizers and optimizer classes marked @tfl.placeable"):
        placement.distributed_optimizer(type("MyOptimizer", (torch.optim.SGD,), {}), Mlp(where), lr=0.1)
    with pytest.raises(InvalidArgumentError, match="travel as JSON"):
        placement.distributed_optimizer(torch.optim.SGD, Mlp(where), lr=torch.tensor(0.1))


def test_a_worker_refuses_an_unregistered_name_or_a_bad_argument_saying_what_to_do(group):
    """Calls of the job's own session (with the token) that a chief of this library would not send: the worker
    refuses each with INVALID_ARGUMENT, says what to do, and builds nothing."""
    chief, _ = group
    link = chief.links[TaskSpec("worker", 1)]

    @placeable
    def only_on_the_chief() -> nn.Module:  # registered here, inside a test: the worker's script has no such thing
        return nn.Linear(2, 2)

    refused = {
        "os.system": "neither a torch.nn module class nor a constructor this worker's script marked @tfl.placeable",
        "subprocess.Popen": "mark it @tfl.placeable at the top level of the script",
        "torch.nn.functional.relu": "it has: two_layers",
        only_on_the_chief.__qualname__: "Run the same script on every task",
        "builtins.eval": "@tfl.placeable",
    }
    for name, words in refused.items():
        with pytest.raises(InvalidArgumentError, match=re.escape(words)):
            link.call("Place", {"constructor": name, "args": ["id"]})
    for args, words in ((["x", 2], "Linear"), ([{"$tensor": 0}, 2], "Linear"), ([[1e308] * 2, 2], "Linear")):
        with pytest.raises(InvalidArgumentError, match=words):
            link.call("Place", {"constructor": "torch.nn.Linear", "args": args})
    for meta, words in (({"constructor": "torch.nn.Linear", "args": "3, 2"}, "'args' must be a list"),
                        ({"constructor": "__import__('os')"}, "must be a Python name"),
                        ({"constructor": "torch.nn.Linear", "args": [3, 2], "device": "cuda:0"}, "'/device:CPU:N'")):
        with pytest.raises(InvalidArgumentError, match=re.escape(words)):
            link.call("Place", meta)
    module = place_module("/job:worker/task:1/cpu:0", nn.Linear, 3, 2)
    with pytest.raises(InvalidArgumentError, match="not a torch.optim optimizer"):
        link.call("Optimizer", {"module": module.module_id, "name": "os.system", "settings": {}})


ATTACKER = """
import json, sys
import grpc
from tensorfleet.wire import codec, rpc
from tensorfleet.wire.rpc import SERVICE, Channel, WireOptions
address, task, methods = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
meta = {{"session": "0" * 32, "constructor": "torch.nn.Linear", "args": [3, 2], "module": 1, "context": 1,
         "tensors": 0, "name": "torch.optim.SGD", "settings": {{"lr": 1.0}}, "chief": "chief:0"}}
answers = {{}}
for method in methods:
    try:  # the project's own client, without a token (what another account has)
        Channel(address, task=task, options=WireOptions(token=None, tls=None)).call(method, meta, timeout=10)
        answers[method + " no token"] = "OK"
    except Exception as exc:
        answers[method + " no token"] = getattr(exc, "code", type(exc).__name__)
    try:  # a forged proof
        channel = grpc.insecure_channel(address)
        channel.unary_unary(f"/{{SERVICE}}/{{method}}")(codec.encode(meta), timeout=10,
                                                       metadata=(("x-tensorfleet-token", "1." + "a" * 200),))
        answers[method + " forged"] = "OK"
    except grpc.RpcError as exc:
        answers[method + " forged"] = exc.code().name
print(json.dumps(answers))
"""


def refused_count(address: str, task: str) -> int:
    channel = Channel(address, task=task, options=WireOptions(token=TOKEN, tls=None))
    try:
        return channel.call("Status")[0]["auth_refused"]
    finally:
        channel.close()


def attack(address: str, task: str) -> dict[str, str]:
    """What every placement call at ``address`` answers a process without the token (another account's): the
    project's own client without a token, then a raw call with a forged proof."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORFLEET_TOKEN")}
    done = subprocess.run([sys.executable, "-c", ATTACKER.format(), address, task, ",".join(PLACEMENT_METHODS)],
                          capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


REFUSED = {f"{method} {how}": "UNAUTHENTICATED" for method in PLACEMENT_METHODS for how in ("no token", "forged")}


def test_a_process_without_the_token_makes_no_member_build_or_run_anything(group):
    """Another account's process at a worker's port: every placement call it makes, without the token or with a
    forged proof, is UNAUTHENTICATED and counted in the worker's Status; the worker keeps serving the job."""
    chief, _ = group
    for index in range(2):
        task = TaskSpec("worker", index)
        address = chief.cluster.task_address("worker", index)
        before = refused_count(address, task.name)
        assert attack(address, task.name) == REFUSED
        assert refused_count(address, task.name) - before == 2 * len(PLACEMENT_METHODS)
    model = Mlp("/job:worker/task:1/cpu:0")  # and the job goes on
    optimizer = placement.distributed_optimizer(torch.optim.SGD, model, lr=0.1)
    placement.train_step(lambda: nn.functional.cross_entropy(model(batch(0)[0]), batch(0)[1]), optimizer)


def listening_ports(pid: int) -> list[tuple[str, int]]:
    """(host, port) of every TCP socket process ``pid`` listens on (a v4-mapped address as IPv4)."""
    return sorted({(_unmapped(c.laddr.ip), c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN})


def _unmapped(host: str) -> str:
    address = ipaddress.ip_address(host)
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def blast(host: str, port: int, generator: random.Random) -> None:
    """Stray bytes at a port: random bytes, an HTTP/2 preface followed by junk, a huge length, a half-open end."""
    payloads = [generator.randbytes(65536), b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + generator.randbytes(4096),
                b"\x00\xff\xff\xff\x04\x00\x00\x00\x00" + b"\xff" * 1024, b"TFLW\x01\xff\xff\xff\xff"]
    for payload in payloads:
        with socket.create_connection((host, port), timeout=10) as sock:
            try:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(5)
                while sock.recv(65536):
                    pass
            except OSError:
                pass  # the member closed it: as it should


def test_stray_bytes_at_every_port_a_member_listens_on_crash_nothing(group):
    """Every port each worker listens on (psutil) is its task's own authenticated port, on loopback; random bytes
    there leave it serving, and the job trains on (the fixture checks both workers leave the group at the end)."""
    chief, workers = group
    generator = random.Random(7)
    for index, process in enumerate(workers):
        host, port = chief.cluster.task_address("worker", index).rsplit(":", 1)
        listening = listening_ports(process.pid)
        assert listening == [(host, int(port))], listening  # nothing else listens: no unauthenticated listener
        for _ in range(3):
            for address, where in listening:
                blast(address, where, generator)
        assert process.poll() is None, "a worker died of stray bytes"
    model = Mlp("/job:worker/task:0/cpu:0")
    optimizer = placement.distributed_optimizer(torch.optim.Adam, model, lr=0.01)
    for step in range(3):
        placement.train_step(lambda: nn.functional.cross_entropy(model(batch(step)[0]), batch(step)[1]), optimizer)


def test_a_cluster_without_a_token_off_loopback_is_refused_unless_the_caller_opts_in(monkeypatch):
    monkeypatch.delenv("TENSORFLEET_INSECURE", raising=False)
    cluster = ClusterSpec.from_dict({"chief": ["10.1.2.3:2222"], "worker": ["10.1.2.4:2222"]})
    no_token = WireOptions(token=None, tls=None)
    with pytest.raises(ConfigError, match="without the job's token") as raised:
        RpcGroup(cluster, TaskSpec("chief", 0), options=no_token)
    assert "--insecure" in str(raised.value) and "10.1.2.4:2222" in str(raised.value)
    assert "TENSORFLEET_TOKEN" in str(raised.value)
    RpcGroup(cluster, TaskSpec("worker", 0), options=WireOptions(token=TOKEN, tls=None))  # checked, not started
    RpcGroup(cluster, TaskSpec("chief", 0), insecure=True, options=no_token)
    monkeypatch.setenv("TENSORFLEET_INSECURE", "1")
    RpcGroup(cluster, TaskSpec("worker", 0), options=no_token)


def test_membership():
    cluster = ClusterSpec.from_dict({"ps": ["127.0.0.1:2222"], "chief": ["127.0.0.1:2225"],
                                     "worker": ["127.0.0.1:2223", "127.0.0.1:2224"]})
    group = RpcGroup(cluster, TaskSpec("worker", 1))
    assert (group.name, group.rank, group.world_size, group.chief_name) == ("worker:1", 2, 3, "chief:0")
    assert group.address == "127.0.0.1:2224"
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


STRAYED_JOB = '''
import argparse, os, sys, time
import torch
from torch import nn
import tensorfleet as tfl
from tensorfleet.coordinator.placement import distributed_optimizer, place_module, run_placed, train_step


def drive(group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), place_module("/job:worker/task:0/cpu:0", nn.Linear, 8, 2))
    optimizer = distributed_optimizer(torch.optim.SGD, model, lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    print("driving", flush=True)
    deadline, losses = time.monotonic() + 100, []
    while not os.path.exists(ARGS.go) and time.monotonic() < deadline:  # train until the test has attacked
        losses.append(float(train_step(lambda: nn.functional.cross_entropy(model(x), y), optimizer)))
    print(f"placed job: {{len(losses)}} steps, loss {{losses[0]:.3f}} -> {{losses[-1]:.3f}}", flush=True)


parser = argparse.ArgumentParser()
tfl.add_cluster_flags(parser)
parser.add_argument("--go", required=True)
ARGS = parser.parse_args()
sys.exit(run_placed(ARGS, drive))
'''


def test_a_launched_placed_job_finishes_through_stray_bytes_and_a_process_without_the_token(tmp_path):
    """``tensorfleet launch --coordinator`` (which gives the job a token): while the chief trains, random bytes go
    to every port the chief and worker 0 listen on (psutil), and a token-less process calls every placement method
    at the worker; both members live on, every call is UNAUTHENTICATED, and the job finishes."""
    from tensorfleet.testing.local_cluster import LauncherProcess

    script, go = tmp_path / "strayed_job.py", tmp_path / "go"
    script.write_text(STRAYED_JOB.format())
    run = LauncherProcess(tmp_path / "logs", ["--coordinator", "--ps", "1", "--workers", "1"], script,
                          ["--go", str(go)])
    try:
        poll(lambda: "[chief:0] driving" in run.output, 90, "the chief to drive")
        pids = {task: run.events_of(task, "started")[-1]["pid"] for task in ("chief:0", "worker:0")}
        generator = random.Random(11)
        for task, pid in pids.items():
            listening = listening_ports(pid)
            assert len(listening) == 1 and listening[0][0] == "127.0.0.1", (task, listening)  # its own port only
            blast(*listening[0], generator)
        host, port = listening_ports(pids["worker:0"])[0]
        assert attack(f"{host}:{port}", "/job:worker/task:0") == REFUSED
        assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids.values())
        go.touch()
        code, output = run.wait(timeout_s=90)
    finally:
        run.kill()
    assert code == 0, output[-3000:]
    steps = re.search(r"\[chief:0\] placed job: (\d+) steps, loss ([\d.]+) -> ([\d.]+)", output)
    assert steps is not None and float(steps[3]) < float(steps[2]), output[-3000:]
    assert f"global step {steps[1]}" in output, output[-3000:]
    assert [e["task"] for e in run.events() if e["event"] == "started"].count("chief:0") == 1, run.events()


MEMBER = """
import sys, time
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.coordinator import placegroup
from tensorfleet.coordinator.placement import RpcGroup
placegroup.LEASE_S = {lease_s}
with RpcGroup(ClusterSpec.from_dict({cluster!r}), TaskSpec(sys.argv[1], 0), start_timeout_s={start_s}) as group:
    print("joined", flush=True)
    if group.is_chief:
        time.sleep(600)  # until SIGKILLed
"""


def test_a_worker_whose_chief_dies_leaves_in_seconds():
    """The chief is SIGKILLed while its worker serves: the worker finds its lease lapsed, and (outside
    ``run_placed``, which would wait for the chief's return) it exits with an error instead of waiting for a
    release that will never come."""
    ports = free_ports(2)
    cluster = ClusterSpec.from_dict({"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    code = MEMBER.format(cluster=cluster.as_dict(), start_s=START_S, lease_s=TEST_LEASE_S)
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
        assert time.monotonic() - killed < TEST_LEASE_S + 20
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
NOISE = ("UserWarning", "DeprecationWarning", "Traceback")


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
    """The chief SIGKILLed mid-run: worker 0 does not exit "done" but keeps serving, the launcher starts the chief
    again, its new session replaces the last one's module on the worker, it resumes from its checkpoint, and the
    summary's global step is the real one."""
    run = placed_launch(tmp_path, "--train_steps", "900", "--save_checkpoint_steps", "300")
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
    assert "global step 900" in output and "1 restart," in output, output
    assert [e["task"] for e in run.events() if e["event"] == "started"].count("worker:0") == 1, run.events()
    worker_log = (run.logdir / "worker-0.log").read_text()
    assert worker_log.count("worker:0 joined chief:0's placement session") == 2, worker_log
    assert "worker:0: a new session of the chief (chief:0 restarted): the 1 module(s) of its last session are " \
           "dropped" in worker_log, worker_log
    assert float(re.search(r"\[chief:0\] test accuracy: ([\d.]+)", output).group(1)) > 0.9, output
    final = json.loads((run.logdir / "chief-0.status.json").read_text())
    assert final["global_step"] == 900 and final["state"] == "done", final
    assert not [line for line in output.splitlines() if any(word in line for word in NOISE)], output


def test_a_killed_placed_worker_is_restarted_and_its_chief_resumes_from_its_checkpoint(tmp_path):
    """Worker 0 SIGKILLed mid-run: the chief's next call fails, it says so in one line and exits 1 (no traceback),
    the launcher starts both again, the new chief places its layer in the new worker and resumes from its
    checkpoint, and the job ends with its real global step."""
    run = placed_launch(tmp_path, "--train_steps", "900", "--save_checkpoint_steps", "300")
    checkpoint = run.logdir / "checkpoints" / "placed.safetensors"
    try:
        poll(checkpoint.exists, 120, "the chief's first checkpoint")
        os.kill(run.events_of("worker:0", "started")[0]["pid"], signal.SIGKILL)
        code, output = run.wait(timeout_s=240)
    finally:
        run.kill()
    assert code == 0, output
    assert "worker:0 killed by SIGKILL; restarting" in output and "chief:0 exit code 1; restarting" in output, output
    assert re.search(r"\[chief:0\] mnist_placed\.py: error: .*\[/job:worker/task:0\] \(exiting, to be started again",
                     output), output
    assert re.search(r"\[chief:0\] resuming from the checkpoint of step \d+", output), output
    assert "global step 900" in output, output
    assert not [line for line in output.splitlines() if any(word in line for word in NOISE)], output


WAITING_MEMBER = '''
import argparse, sys, time
import tensorfleet as tfl
from tensorfleet.coordinator import placegroup
from tensorfleet.coordinator.placement import run_placed
placegroup.LEASE_S = {lease_s}


def drive(group):
    print("driving", flush=True)
    time.sleep(600)  # until SIGKILLed


parser = argparse.ArgumentParser()
tfl.add_cluster_flags(parser)
sys.exit(run_placed(parser.parse_args(), drive, start_timeout_s={timeout_s}))
'''


def test_a_worker_waits_a_bounded_time_for_its_chief_to_come_back_saying_so(tmp_path):
    """By hand, no launcher to restart the chief: once its lease lapsed, the worker waits ``start_timeout_s`` for
    it, then exits 1 saying what it waited for."""
    ports = free_ports(2)
    tf_config = {"cluster": {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}}
    script = tmp_path / "member.py"
    script.write_text(WAITING_MEMBER.format(timeout_s=8, lease_s=TEST_LEASE_S))
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
    assert re.search(r"^member\.py: error: worker:0: waited 8 s for the chief \(chief:0\) to come back at "
                     r"127\.0\.0\.1:\d+ \(it left: worker:0: the chief \(chief:0\) does not answer any more",
                     out.splitlines()[-1]), out
