"""In-graph replication against real ps servers on 127.0.0.1: a coordinator schedules remote functions on
workers (threads here, each with its own closure server and replica) and gets their results."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.coordinator.coordinator import Coordinator, RemoteError
from tensorfleet.coordinator.remote import WorkerContext, worker_context
from tensorfleet.coordinator.worker import ClosureServer
from tensorfleet.errors import InvalidArgumentError
from tensorfleet.launch.local import free_ports
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.ps.server import Server
from tensorfleet.testing.models import seeded_mlp
from tensorfleet.train.session import TrainingSession
from tensorfleet.worker.replica import Replica

STEPS, BATCH, LR = 15, 8, 0.1
INITIAL = seeded_mlp(12, 16, 3, scale=0.3)


def batch_for(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 12, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator)


@tfl.remote
def batches(first: int, count: int = STEPS):
    """Each worker's own data: an iterator built where it is used."""
    return iter([batch_for(step) for step in range(first, first + count)])


@tfl.remote
def train_step(data):
    context = worker_context()
    images, labels = next(data)
    return context.session.run_step(lambda: nn.functional.cross_entropy(context.model(images), labels)).loss


@tfl.remote
def fails(text: str):
    raise ValueError(text)


@tfl.remote
def echo(value):
    return value


@tfl.remote
def slow(seconds: float):
    import time
    time.sleep(seconds)
    return seconds


def not_remote():
    return 1


@pytest.fixture
def fleet():
    """1 ps, 2 workers serving closures (threads), and the coordinator's place (the chief) in the cluster."""
    ports = free_ports(4)
    cluster = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{ports[0]}"], "chief": [f"127.0.0.1:{ports[1]}"],
                                     "worker": [f"127.0.0.1:{p}" for p in ports[2:]]})
    ps = Server(cluster, job_name="ps", task_index=0)
    servers: list[ClosureServer] = []
    started = threading.Barrier(3, timeout=60)

    def worker(index: int) -> None:
        task = TaskSpec("worker", index)
        replica = Replica(copy.deepcopy(INITIAL), cluster, task, optimizer=OptimizerSpec.sgd(lr=LR), mode="async")
        with TrainingSession(replica, log_step_count_steps=None) as session:
            server = ClosureServer(cluster, task, WorkerContext(session=session))
            servers.append(server)
            started.wait()
            server.serve()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(2)]
    chief = Replica(copy.deepcopy(INITIAL), cluster, TaskSpec("chief", 0), optimizer=OptimizerSpec.sgd(lr=LR),
                    mode="async")
    session = TrainingSession(chief, log_step_count_steps=None)
    try:
        for thread in threads:
            thread.start()
        session.__enter__()  # the chief initializes the ps; the workers were waiting for it
        started.wait()
        yield cluster, session
    finally:
        for server in servers:
            server.finished.set()
        for thread in threads:
            thread.join(timeout=30)
        session.__exit__(None, None, None)
        ps.stop(grace_s=0)


def test_one_worker_through_the_coordinator_ends_where_the_local_loop_ends(fleet):
    cluster, session = fleet
    one = ClusterSpec.from_dict({**cluster.as_dict(), "worker": cluster.as_dict()["worker"][:1]})
    reference = copy.deepcopy(INITIAL)
    local = torch.optim.SGD(reference.parameters(), lr=LR)
    expected_losses = []
    for step in range(STEPS):
        images, labels = batch_for(step)
        local.zero_grad()
        loss = nn.functional.cross_entropy(reference(images), labels)
        expected_losses.append(loss.item())
        loss.backward()
        local.step()

    coordinator = Coordinator(one)
    data = coordinator.create_per_worker_dataset(batches, args=(0,))
    values = [coordinator.schedule(train_step, args=(data,)) for _ in range(STEPS)]
    coordinator.join()
    assert coordinator.done() and all(v.worker == "/job:worker/task:0" for v in values)
    torch.testing.assert_close(torch.tensor([v.fetch() for v in values]), torch.tensor(expected_losses),
                               rtol=1e-5, atol=1e-6)
    assert session.replica.pull() == STEPS
    for (name, param), expected in zip(session.replica.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_closures_spread_over_the_workers_and_results_and_errors_come_back(fleet):
    cluster, session = fleet
    coordinator = Coordinator(cluster)
    # Enough for either worker to take every closure: the free one takes the next, so the split is uneven.
    data = coordinator.create_per_worker_dataset(batches, args=(0, 2 * STEPS))
    trained = [coordinator.schedule(train_step, args=(data,)) for _ in range(2 * STEPS)]
    coordinator.join()
    assert {v.worker for v in trained} == {"/job:worker/task:0", "/job:worker/task:1"}
    assert session.replica.pull() == 2 * STEPS

    tensor = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(coordinator.schedule(echo, args=(tensor,)).fetch(), tensor)
    nested = {"a": [1, 2.5, "x", None], "t": tensor}
    back = coordinator.schedule(echo, args=(nested,)).fetch()
    assert back["a"] == [1, 2.5, "x", None] and torch.equal(back["t"], tensor)

    failed = coordinator.schedule(fails, args=("on purpose",))
    with pytest.raises(RemoteError, match=r"(?s)fails raised ValueError on /job:worker/task:\d.*on purpose"):
        failed.fetch()
    with pytest.raises(RemoteError, match="on purpose"):
        coordinator.join()  # join raises the error once
    coordinator.join()
    assert coordinator.schedule(echo, args=(3,)).fetch() == 3  # the worker goes on after a function's error

    with pytest.raises(InvalidArgumentError, match="'not_remote' is not a remote function: mark it @tfl.remote"):
        coordinator.schedule(not_remote)
    with pytest.raises(InvalidArgumentError, match="a object cannot be sent to or from a worker"):
        coordinator.schedule(echo, args=(object(),))
    with pytest.raises(InvalidArgumentError, match="does not travel as JSON"):
        coordinator.schedule(echo, args=(float("nan"),))
    coordinator.shutdown()


def test_a_driver_that_fails_cancels_what_no_worker_took_and_the_workers_are_told_done(fleet):
    import time

    from tensorfleet.coordinator.coordinator import CancelledError
    from tensorfleet.errors import DeadlineExceededError, UnavailableError
    from tensorfleet.testing.fleet import poll
    from tensorfleet.wire.rpc import Channel

    cluster, _ = fleet
    coordinator = Coordinator(cluster)
    values = [coordinator.schedule(slow, args=(0.5,)) for _ in range(20)]
    with pytest.raises(RuntimeError, match="the driver failed"):
        with coordinator:
            poll(values[0].done, 10, "the first closure to run")  # the workers are busy with the next ones
            began = time.monotonic()
            raise RuntimeError("the driver failed")
    assert time.monotonic() - began < 10  # not the 20 closures' 5 s each worker would need, nor a hang
    outcomes = [v.fetch(timeout_s=10) if v.done() and v._error is None else v._error for v in values]
    cancelled = [o for o in outcomes if isinstance(o, CancelledError)]
    assert 10 <= len(cancelled) <= 17 and all(o == 0.5 for o in outcomes if not isinstance(o, Exception)), outcomes

    def stopped(address: str) -> bool:  # told Done, a worker stops serving
        channel = Channel(address, task="/job:worker/task:0")
        try:
            channel.call("Status", timeout=1.0)
            return False
        except (UnavailableError, DeadlineExceededError):
            return True
        finally:
            channel.close()
    for address in cluster.as_dict()["worker"]:
        poll(lambda: stopped(address), 20, f"the worker at {address} to stop serving")


# --- under the launcher, as processes ------------------------------------------------------------------------

def test_the_seed_job_through_the_coordinator_survives_a_sigkilled_worker(tmp_path):
    """``tensorfleet launch --coordinator``: the coordinator (chief:0) drives 2 workers; worker:1 is SIGKILLed
    mid-run: its closure runs again on worker:0, and the restarted worker rejoins (its data built again)."""
    import os
    import re
    import signal

    from tensorfleet.testing.fleet import poll
    from tensorfleet.testing.local_cluster import REPO, LauncherProcess

    run = LauncherProcess(tmp_path / "job", ["--coordinator", "--ps", "1", "--workers", "2", "--max-restarts", "2",
                                             "--progress-every", "1"],
                          REPO / "examples" / "mnist_coordinator.py", ["--train_steps", "6000"])
    try:
        poll(lambda: run.events_of("worker:1", "running") and "[launch] step " in run.output, 120,
             "worker:1 to run closures")  # the queue holds 120 closures: it always has one in flight
        victim = run.events_of("worker:1", "started")[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        poll(lambda: len(run.events_of("worker:1", "started")) == 2, 60, "worker:1 to be restarted")
        code, output = run.wait(timeout_s=240)
    finally:
        run.kill()
    assert code == 0, output
    assert re.search(r"\[chief:0\].*/job:worker/task:1 could not run train_step .*back to the queue", output), output
    assert "ran on 2 worker(s)" in output
    step = int(re.search(r"global step (\d+)", re.findall(r"\[chief:0\] Coordinator: .*", output)[-1]).group(1))
    assert step >= 6000  # a closure cut short ran again whole: at least once
    assert float(re.search(r"\[chief:0\] test accuracy: ([\d.]+)", output).group(1)) > 0.95, output
    log1 = (tmp_path / "job" / "worker-1.log").read_text()
    assert log1.count("=== worker:1 incarnation") == 2
