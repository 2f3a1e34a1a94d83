"""The seed MNIST MLP with its output layer on a worker (``place_module``) against the same MLP all local.

The chief (this process) holds the hidden layer, worker 0 (another process) the output layer; every step sends
the hidden activations there and the logits back, then in the backward the logits' gradient there and the
activations' gradient back (the job's own gRPC over TCP, every call proving the job's token, as between
machines). The bytes are measured on the worker, over the timed steps: what its process read and wrote
(``/proc/PID/io`` rchar/wchar: the sockets, and gRPC's event-loop wakeups) and, where ``ss`` is there, what its
TCP sockets carried (``bytes_received``/``bytes_sent``). Next to them: the analytic figure (the tensors that must
cross) and what a between-graph worker of the seed job moves per step (a pull and a push of all 79,510 parameters,
float32), analytic and measured the same way on its ps.

Rows: a plain local loop (forward, backward, torch.optim.Adam), the same model through ``train_step`` and
``distributed_optimizer`` without leaving the process (the machinery's own cost), the placed model, and the seed
job's between-graph step (pull, forward, backward, push; Adam on a ps in another process, over TCP: shared memory
off, polling as ``tensorfleet launch`` would set it for this run's three processes: none on a 2-core machine).
Adam lr 0.01, batch 100, one intra-op thread per process; steps/s are medians over interleaved repeats. The local
and placed models train on the same batches from the same start, and end equal (printed).

    python benchmarks/remote_placement.py [--steps 200] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from mnist_mlp import REPO_DATA, build_model  # noqa: E402

import tensorfleet as tfl  # noqa: E402
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec  # noqa: E402
from tensorfleet.coordinator import placement  # noqa: E402
from tensorfleet.data.mnist import batches, load_mnist  # noqa: E402
from tensorfleet.cluster.machine import busy_poll_for  # noqa: E402
from tensorfleet.cluster.ports import free_ports  # noqa: E402
from tensorfleet.wire.auth import TOKEN_ENV, new_token  # noqa: E402
from tensorfleet.wire.rpc import BUSY_POLL_ENV, SHARED_MEMORY_ENV, WireOptions  # noqa: E402

TOKEN = new_token()  # the placed job's, as tensorfleet launch gives one: every call proves it
WORKER = """
import torch
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.coordinator.placement import RpcGroup
torch.set_num_threads(1)
with RpcGroup(ClusterSpec.from_dict({cluster!r}), TaskSpec("worker", 0), start_timeout_s=60):
    pass
"""


class PlacedMlp(nn.Module):
    """``build_model``'s MLP with its output layer (``[2]``) on ``device``, started from ``initial``'s values."""

    def __init__(self, initial: nn.Sequential, device: str) -> None:
        super().__init__()
        self.hidden = copy.deepcopy(initial[0])
        self.out = placement.place_module(device, nn.Linear, initial[2].in_features, initial[2].out_features)
        self.out.load_state_dict(initial[2].state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def io_bytes(pid: int) -> tuple[int, int]:
    """(rchar, wchar) of a process: every byte its read and write calls moved, sockets included."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def tcp_bytes(pid: int) -> tuple[int, int] | None:
    """(received, sent) over the TCP sockets of a process, from ``ss -tinp`` (None without ``ss``)."""
    if shutil.which("ss") is None:
        return None
    text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=10).stdout
    received = sent = 0
    for socket_line, info in zip(text.splitlines()[::2], text.splitlines()[1::2]):
        if f"pid={pid}," in socket_line:
            received += int((re.search(r"bytes_received:(\d+)", info) or [0, 0])[1])
            sent += int((re.search(r"bytes_sent:(\d+)", info) or [0, 0])[1])
    return received, sent


def timed(step: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per repeat and row")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=100)
    parser.add_argument("--hidden_units", type=int, default=100)
    parser.add_argument("--data_dir", default=str(REPO_DATA))
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stream = batches(load_mnist(args.data_dir).train, args.batch_size, seed=0)
    rounds = [[next(stream) for _ in range(args.steps)] for _ in range(args.repeats + 1)]  # + a warm-up round

    ports = free_ports(4)
    cluster = ClusterSpec.from_dict({"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    between = ClusterSpec.from_dict({"ps": [f"127.0.0.1:{ports[2]}"], "worker": [f"127.0.0.1:{ports[3]}"]})
    worker = subprocess.Popen([sys.executable, "-c", WORKER.format(cluster=cluster.as_dict())],
                              env={**os.environ, TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1"})
    ps = start_ps(between)
    try:
        with placement.RpcGroup(cluster, TaskSpec("chief", 0), start_timeout_s=60,
                                options=WireOptions(token=TOKEN, shared_memory=False)):
            figures = measure(args, rounds, worker.pid, between, ps.pid)
        worker.wait(timeout=60)
        ps.wait(timeout=60)
    finally:
        for process in (worker, ps):
            if process.poll() is None:
                process.kill()
                process.wait()
    report(args, figures)
    return 0


def start_ps(cluster: ClusterSpec) -> subprocess.Popen:
    """The between-graph job's ps, on TCP (no shared memory), polling as the launcher would set it for 3 tasks."""
    env = {**os.environ, "TF_CONFIG": cluster.to_tf_config(TaskSpec("ps", 0)), "OMP_NUM_THREADS": "1",
           SHARED_MEMORY_ENV: "0", BUSY_POLL_ENV: str(busy_poll_for(3))}
    return subprocess.Popen([sys.executable, "-m", "tensorfleet.ps"], env=env, stdout=subprocess.DEVNULL)


def between_graph_step(model: nn.Module, cluster: ClusterSpec) -> tuple[tfl.Replica, Callable]:
    """The seed job's worker step against the ps: pull, forward, backward, push (Adam runs on the ps)."""
    replica = tfl.Replica(model, cluster, TaskSpec("worker", 0), optimizer=tfl.OptimizerSpec.adam(lr=0.01),
                          wire=WireOptions(busy_poll_us=busy_poll_for(3), shared_memory=False)).start()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        replica.pull()
        nn.functional.cross_entropy(model(images), labels).backward()
        replica.push()
    return replica, step


class Traffic:
    """Bytes one process moved over the timed rounds: its read/write calls and its TCP sockets."""

    def __init__(self, pid: int) -> None:
        self.pid, self.totals, self.steps = pid, [0, 0, 0, 0], 0
        self._before: tuple = ()

    def start(self) -> None:
        self._before = (io_bytes(self.pid), tcp_bytes(self.pid))

    def stop(self, steps: int) -> None:
        io, tcp = io_bytes(self.pid), tcp_bytes(self.pid)
        io_before, tcp_before = self._before
        deltas = [io[0] - io_before[0], io[1] - io_before[1]]
        deltas += [0, 0] if tcp is None or tcp_before is None else [tcp[0] - tcp_before[0], tcp[1] - tcp_before[1]]
        self.totals = [total + delta for total, delta in zip(self.totals, deltas)]
        self.steps += steps

    def per_step(self) -> dict[str, float]:
        steps = max(1, self.steps)
        names = ("io_read", "io_written", "tcp_received", "tcp_sent")
        return {name: total / steps for name, total in zip(names, self.totals)}


def measure(args: argparse.Namespace, rounds: list, worker_pid: int, between: ClusterSpec, ps_pid: int) -> dict:
    initial = build_model(args.hidden_units)
    local, machinery, between_model = (copy.deepcopy(initial) for _ in range(3))
    placed = PlacedMlp(initial, "/job:worker/task:0/device:CPU:0")
    adam = torch.optim.Adam(local.parameters(), lr=0.01)
    machinery_adam = placement.distributed_optimizer(torch.optim.Adam, machinery, lr=0.01)
    placed_adam = placement.distributed_optimizer(torch.optim.Adam, placed, lr=0.01)
    replica, between_step = between_graph_step(between_model, between)
    loss = nn.functional.cross_entropy

    def local_step(images: torch.Tensor, labels: torch.Tensor) -> None:
        adam.zero_grad()
        loss(local(images), labels).backward()
        adam.step()

    steps = {"local": local_step,
             "local, train_step": lambda x, y: placement.train_step(lambda: loss(machinery(x), y), machinery_adam),
             "placed": lambda x, y: placement.train_step(lambda: loss(placed(x), y), placed_adam),
             "between-graph (1 ps)": between_step}
    traffic = {"placed": Traffic(worker_pid), "between-graph (1 ps)": Traffic(ps_pid)}
    speeds: dict[str, list[float]] = {name: [] for name in steps}
    for index, data in enumerate(rounds):  # the first round warms up (and opens the connections)
        for name, step in steps.items():
            if name in traffic:
                traffic[name].start()
            batch = iter(data)
            speed = timed(lambda: step(*next(batch)), len(data))  # noqa: B023 (called at once)
            if index and name in traffic:
                traffic[name].stop(len(data))
            if index:
                speeds[name].append(speed)
    replica.finish()
    wanted, got = local.state_dict(), placed.state_dict()
    difference = max((got[f"{new}.{p}"] - wanted[f"{old}.{p}"]).abs().max().item()
                     for old, new in (("0", "hidden"), ("2", "out")) for p in ("weight", "bias"))
    return {"speeds": speeds, "moved": {name: t.per_step() for name, t in traffic.items()},
            "max_param_difference": difference, "parameters": sum(p.numel() for p in local.parameters())}


def report(args: argparse.Namespace, figures: dict) -> None:
    speeds, moved = figures["speeds"], figures["moved"]
    median = {name: statistics.median(values) for name, values in speeds.items()}
    activations = args.batch_size * args.hidden_units * 4 * 2  # the hidden activations there, their gradient back
    logits = args.batch_size * 10 * 4 * 2  # the logits back, their gradient there
    analytic = {"placed": activations + logits, "between-graph (1 ps)": 2 * figures["parameters"] * 4}
    what = {"placed": "activations + logits, and their gradients", "between-graph (1 ps)": "pull + push of all "
            f"{figures['parameters']:,} parameters"}
    print(f"\nseed MNIST MLP 784-{args.hidden_units}-10, batch {args.batch_size}, Adam, {args.steps} steps x "
          f"{args.repeats} repeats, medians; placed: the job's gRPC over TCP, token-checked\n")
    print(f"{'run':<24} {'steps/s':>8} {'vs local':>9}")
    for name, value in median.items():
        print(f"{name:<24} {value:>8.0f} {value / median['local']:>8.2f}x")
    print(f"\n{'bytes per step':<24} {'analytic':>9} {'io r+w':>9} {'TCP':>9}   analytic: what must cross")
    rows = {}
    for name, per in moved.items():
        rows[name] = {"analytic": analytic[name], "io": per["io_read"] + per["io_written"],
                      "tcp": per["tcp_received"] + per["tcp_sent"], **per}
        io = f"{rows[name]['io']:>9,.0f}" if rows[name]["io"] else f"{'-':>9}"
        print(f"{name:<24} {analytic[name]:>9,} {io} {rows[name]['tcp']:>9,.0f}   {what[name]}")
    print("\n  measured on the worker (placed) and on the ps (between-graph) over the timed steps: what the process's "
          "read/write calls moved\n  (/proc/PID/io; gRPC and the ps move their bytes with sendmsg/recvmsg, which "
          "it does not count: '-' or a few bytes) "
          "and what its TCP sockets carried (ss)")
    print(f"  after {args.steps * (args.repeats + 1)} steps, the placed and local models' parameters differ by at most "
          f"{figures['max_param_difference']:.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {"steps": args.steps, "repeats": args.repeats, "batch_size": args.batch_size,
                       "hidden_units": args.hidden_units, "transport": "grpc (tcp, token)", "cpus": os.cpu_count()},
            "steps_per_s": speeds, "steps_per_s_median": median, "bytes_per_step": rows,
            "max_param_difference": figures["max_param_difference"]}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
