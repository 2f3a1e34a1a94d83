"""Towers on the CPU: examples/sec with K = 1 and K = 2, against torch DistributedDataParallel, in one run.

The MNIST CNN of ``examples/mnist_cnn.py`` (1.66 M parameters), a global batch of 64
synthetic images split over the towers, SGD with momentum 0.9, one intra-op thread
per process.  Configurations, each in fresh processes, interleaved ``--repeats`` times:

* towers, K = 1: ``run_towers`` with one tower (this process; no collective);
* towers, K = 2: ``run_towers`` (tower 1 spawned), ``towers.wrap`` (DDP), ``towers.split``;
* torch DDP, 2 processes: the reference, written as torch's tutorial does
  (``init_process_group("gloo")``, ``DistributedDataParallel``, each rank half the batch);
* hybrid, K = 1 and K = 2: one worker whose towers push to 1 ps (async) through
  ``TowerReplica``: the ps applies the update; tower 0 broadcasts the new values.

Examples/sec = 64 x timed steps / wall time of the timed steps (after a warm-up, all
towers started together by a barrier); a configuration's figure is the median of its
runs, and a ratio the median of the ratios within each repeat.  On 2 cores, K = 2 CPU towers show the cost of the path, not a speed-up: one
process already has a core, and the two towers share both with the collective.

    python benchmarks/towers.py [--steps 30] [--repeats 3] [--json towers.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import tensorfleet as tfl  # noqa: E402
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec  # noqa: E402
from tensorfleet.cluster.ports import free_ports, local_cluster  # noqa: E402
from mnist_cnn import ConvNet  # noqa: E402

BATCH, WARMUP, LR, MOMENTUM = 64, 5, 0.01, 0.9


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.rand(BATCH, 784, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)


def timed(steps: int, step, barrier) -> float:
    """Seconds of ``steps`` calls of ``step`` after WARMUP untimed ones, every tower starting together."""
    for _ in range(WARMUP):
        step()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    barrier()
    return time.perf_counter() - start


def local_towers(towers: tfl.Towers, steps: int) -> float:
    torch.manual_seed(0)
    model = ConvNet().to(towers.device)
    net = towers.wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = towers.split(*global_batch())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    return timed(steps, step, towers.barrier)


def hybrid_towers(towers: tfl.Towers, cluster: ClusterSpec, steps: int) -> float:
    torch.manual_seed(0)
    model = ConvNet().to(towers.device)
    replica = tfl.TowerReplica(towers, model, cluster, TaskSpec("worker", 0),
                               optimizer=tfl.OptimizerSpec.sgd(lr=LR, momentum=MOMENTUM))
    x, y = towers.split(*global_batch())

    def step() -> None:
        replica.pull()
        nn.functional.cross_entropy(replica.model(x), y).backward()
        replica.push()
    with replica:
        return timed(steps, step, towers.barrier)


def ddp_rank(rank: int, port: int, steps: int) -> float:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    torch.manual_seed(0)
    model = ConvNet()
    net = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = (t[rank * BATCH // 2:(rank + 1) * BATCH // 2] for t in global_batch())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    elapsed = timed(steps, step, dist.barrier)
    dist.destroy_process_group()
    return elapsed


# --- the driver: each configuration in fresh processes (this script with --role) --------------------

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def seconds_of(commands: list[list[str]], env: dict | None = None) -> float:
    """Run one process per command (this script, --role ...); the slowest one's timed seconds."""
    processes = [subprocess.Popen([sys.executable, __file__, *command], stdout=subprocess.PIPE, text=True,
                                  env=env or ENV) for command in commands]
    outputs = [p.communicate(timeout=600)[0] for p in processes]
    if any(p.returncode for p in processes):
        raise RuntimeError(f"a benchmark process failed: {[p.returncode for p in processes]}")
    return max(float(output.strip().splitlines()[-1]) for output in outputs)


def run_towers_config(towers: int, steps: int) -> float:
    return seconds_of([["--role", "towers", "--towers", str(towers), "--steps", str(steps)]])


def run_ddp(steps: int) -> float:
    port = free_ports(1)[0]
    return seconds_of([["--role", "ddp", "--rank", str(r), "--port", str(port), "--steps", str(steps)]
                       for r in range(2)])


def run_hybrid(towers: int, steps: int) -> float:
    cluster = local_cluster(1, 1)
    ps = subprocess.Popen([sys.executable, "-m", "tensorfleet.ps"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, env={**ENV, "TF_CONFIG": cluster.to_tf_config(TaskSpec("ps", 0))})
    try:
        return seconds_of([["--role", "hybrid", "--towers", str(towers), "--steps", str(steps),
                            "--cluster", json.dumps(cluster.as_dict())]])
    finally:
        try:
            ps.wait(timeout=30)  # it exits once the worker said Done
        except subprocess.TimeoutExpired:
            ps.kill()
            ps.wait()


def role(args: argparse.Namespace) -> float:
    torch.set_num_threads(1)
    if args.role == "ddp":
        return ddp_rank(args.rank, args.port, args.steps)
    options = tfl.TowerOptions(num_towers=args.towers, device_type="cpu")
    if args.role == "towers":
        return tfl.run_towers(local_towers, args.steps, options=options)
    cluster = ClusterSpec.from_dict(json.loads(args.cluster))
    return tfl.run_towers(hybrid_towers, cluster, args.steps, options=options)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration, interleaved")
    parser.add_argument("--json", default=None)
    parser.add_argument("--role", choices=["towers", "hybrid", "ddp"], help=argparse.SUPPRESS)
    parser.add_argument("--towers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        print(role(args))
        return 0

    configurations = {"towers, K=1": lambda: run_towers_config(1, args.steps),
                      "towers, K=2": lambda: run_towers_config(2, args.steps),
                      "torch DDP, 2 processes": lambda: run_ddp(args.steps),
                      "hybrid (1 ps), K=1": lambda: run_hybrid(1, args.steps),
                      "hybrid (1 ps), K=2": lambda: run_hybrid(2, args.steps)}
    runs: dict[str, list[float]] = {name: [] for name in configurations}
    for _ in range(args.repeats):  # interleaved, so drifting load hits every configuration alike
        for name, run in configurations.items():
            runs[name].append(BATCH * args.steps / run())
    rates = {name: statistics.median(values) for name, values in runs.items()}
    ddp = rates["torch DDP, 2 processes"]

    def paired(a: str, b: str) -> float:
        """Median over repeats of a/b within each repeat: load that drifts between repeats cancels out."""
        return statistics.median(x / y for x, y in zip(runs[a], runs[b]))
    ratios = {"towers K=2 / DDP": paired("towers, K=2", "torch DDP, 2 processes"),
              "hybrid K=2 / DDP": paired("hybrid (1 ps), K=2", "torch DDP, 2 processes"),
              "towers K=2 / K=1": paired("towers, K=2", "towers, K=1"),
              "hybrid K=2 / K=1": paired("hybrid (1 ps), K=2", "hybrid (1 ps), K=1")}
    params = sum(p.numel() for p in ConvNet().parameters())
    print(f"MNIST CNN ({params / 1e6:.2f} M parameters), global batch {BATCH}, {args.steps} timed steps, "
          f"median of {args.repeats} runs, {os.cpu_count()} cores")
    print(f"{'configuration':<26}{'examples/sec':>14}{'sec/batch':>11}{'vs DDP':>9}")
    for name, rate in rates.items():
        print(f"{name:<26}{rate:>14.1f}{BATCH / rate:>11.3f}{rate / ddp:>8.2f}x")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x (median of the per-repeat ratios)")
    if args.json:
        result = {"model": "mnist_cnn.ConvNet", "parameters": params, "global_batch": BATCH, "steps": args.steps,
                  "repeats": args.repeats, "examples_per_sec": rates, "examples_per_sec_runs": runs,
                  "ratios": ratios}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
