"""Goals 3 and 4: 2 sync workers + 2 ps against torch DistributedDataParallel (gloo), same model, batch, machine.

The model is a wide MLP of ~15.8 M float32 parameters (2048-4096-1792-10), the
batch 64 per worker on synthetic data, SGD with momentum 0.9 on both sides, one
intra-op thread per process.  Three configurations run one after another in this
script, each for the same number of timed steps after a warm-up:

* DDP: 2 processes, gloo all-reduce (bucketed, overlapped with backward);
* tensorfleet sync, 2 workers + 2 ps (greedy placement, large variables in 2 row
  parts so both ps carry half), gradients pushed after backward (overlap off);
* the same with overlap on (each gradient leaves during backward);
* overlap on with gradients and values in bfloat16 on the wire (goal 6; the ps stays fp32);
* overlap on with bodies over loopback TCP instead of shared memory
  (``TENSORFLEET_SHARED_MEMORY=0``), as between hosts.

Tasks on one host move message bodies through shared memory by default
(``tensorfleet.wire.shm``); gloo moves DDP's over loopback TCP.

Samples/sec = 2 workers x batch x steps / wall time of the timed steps; the
figure of a configuration is the median of ``--repeats`` interleaved runs.

    python benchmarks/vs_ddp.py [--steps 30] [--repeats 3] [--json vs_ddp.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.cluster.ports import free_ports, local_cluster
from tensorfleet.wire.rpc import SHARED_MEMORY_ENV

BATCH, WARMUP, LR, MOMENTUM = 64, 5, 0.01, 0.9


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 1792), nn.ReLU(), nn.Linear(1792, 10))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(BATCH, 2048, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)


def ddp_worker(rank: int, port: int, steps: int, *, master: str = "127.0.0.1", fp16: bool = False) -> float:
    """Seconds of ``steps`` DDP steps after the warm-up; ``fp16``: gradients all-reduced in 16 bits (DDP's
    ``fp16_compress_hook``; its bf16 hook needs CUDA)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", world_size=2, rank=rank)
    model = nn.parallel.DistributedDataParallel(build_model())
    if fp16:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = batch(rank)
    for step in range(WARMUP + steps):
        if step == WARMUP:
            dist.barrier()
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    return elapsed


def tensorfleet_worker(cluster: ClusterSpec, index: int, steps: int, overlap: bool, bf16: bool,
                       dense: str = "ps") -> float:
    """``dense="allreduce"``: hybrid mode (the dense parameters by gloo all-reduce, only the step on the ps)."""
    model = build_model()
    replica = tfl.Replica(model, cluster, TaskSpec("worker", index), optimizer=tfl.OptimizerSpec.sgd(
        lr=LR, momentum=MOMENTUM), mode="sync", placement=tfl.GreedyByBytes(),
        partitioner=tfl.RowPartitioner(num_parts=2, min_bytes=1 << 20), overlap=overlap,
        wire_dtype=torch.bfloat16 if bf16 else None, dense=dense)
    with replica:
        return timed_steps(replica, model, index, steps)


def timed_steps(replica: tfl.Replica, model: nn.Module, rank: int, steps: int) -> float:
    """Seconds of ``steps`` training steps (pull, forward, backward, push) after the warm-up ones."""
    x, y = batch(rank)
    for step in range(WARMUP + steps):
        if step == WARMUP:
            start = time.perf_counter()
        replica.pull()
        nn.functional.cross_entropy(model(x), y).backward()
        replica.push()
    replica.settle()  # a prefetching push's reply is part of the work
    return time.perf_counter() - start


def run_workers(role_args: list[list[str]], env: dict[str, str] | None = None) -> list[float]:
    """Start one process per worker (this script, --role ...); return each one's timed seconds."""
    env = env or {**os.environ, "OMP_NUM_THREADS": "1"}
    workers = [subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=env)
               for args in role_args]
    return [float(worker.communicate(timeout=600)[0].strip().splitlines()[-1]) for worker in workers]


def run_ddp(steps: int) -> float:
    port = free_ports(1)[0]
    return max(run_workers([["--role", "ddp", "--rank", str(r), "--port", str(port), "--steps", str(steps)]
                            for r in range(2)]))


@contextlib.contextmanager
def ps_processes(cluster: ClusterSpec, env: dict[str, str], *,
                 on_host: Callable[[str, list[str]], list[str]] | None = None,
                 wait_s: float = 30.0) -> Iterator[None]:
    """Every ps task of ``cluster`` as a quiet process (``on_host(task, argv)``: the command that runs argv on
    that task's host, if not this one); on leaving, wait up to ``wait_s`` for them to exit (they do once every
    worker is done), killing any that does not."""
    command = [sys.executable, "-m", "tensorfleet.ps"]
    ps = [subprocess.Popen(on_host(f"ps:{i}", command) if on_host else command, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={**env, "TF_CONFIG": cluster.to_tf_config(TaskSpec("ps", i))})
          for i in range(len(cluster.ps_addresses))]
    try:
        yield
    finally:
        for process in ps:
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_tensorfleet(steps: int, overlap: bool, bf16: bool = False, shared_memory: bool = True) -> float:
    cluster = local_cluster(2, 2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", SHARED_MEMORY_ENV: "1" if shared_memory else "0"}
    with ps_processes(cluster, env):
        spec = json.dumps(cluster.as_dict())
        return max(run_workers([["--role", "tensorfleet", "--cluster", spec, "--index", str(i), "--steps", str(steps),
                                 *(["--overlap"] if overlap else []), *(["--bf16"] if bf16 else [])]
                                for i in range(2)], env))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration, interleaved")
    parser.add_argument("--json", default=None)
    parser.add_argument("--role", choices=["ddp", "tensorfleet"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.role == "ddp":
        print(ddp_worker(args.rank, args.port, args.steps))
        return 0
    if args.role == "tensorfleet":
        cluster = ClusterSpec.from_dict(json.loads(args.cluster))
        print(tensorfleet_worker(cluster, args.index, args.steps, args.overlap, args.bf16))
        return 0

    params = sum(p.numel() for p in build_model().parameters())
    samples = 2 * BATCH * args.steps
    configurations = {"DDP (gloo)": lambda: run_ddp(args.steps),
                      "tensorfleet sync, overlap off": lambda: run_tensorfleet(args.steps, overlap=False),
                      "tensorfleet sync, overlap on": lambda: run_tensorfleet(args.steps, overlap=True),
                      "overlap on, bf16 on the wire": lambda: run_tensorfleet(args.steps, overlap=True, bf16=True),
                      "overlap on, over TCP": lambda: run_tensorfleet(args.steps, overlap=True, shared_memory=False)}
    runs: dict[str, list[float]] = {name: [] for name in configurations}
    for _ in range(args.repeats):  # interleaved, so drifting load hits every configuration alike
        for name, run in configurations.items():
            runs[name].append(samples / run())
    rates = {name: statistics.median(values) for name, values in runs.items()}
    ddp = rates["DDP (gloo)"]
    result = {"parameters": params, "batch_per_worker": BATCH, "steps": args.steps, "repeats": args.repeats,
              "samples_per_sec": rates, "samples_per_sec_runs": runs,
              "goal3_ratio_to_ddp": rates["tensorfleet sync, overlap on"] / ddp,
              "ratio_overlap_off_to_ddp": rates["tensorfleet sync, overlap off"] / ddp,
              "goal4_overlap_gain": rates["tensorfleet sync, overlap on"] / rates["tensorfleet sync, overlap off"],
              "goal6_bf16_ratio_to_ddp": rates["overlap on, bf16 on the wire"] / ddp,
              "ratio_over_tcp_to_ddp": rates["overlap on, over TCP"] / ddp}
    print(f"MLP of {params / 1e6:.1f} M parameters, 2 workers x batch {BATCH}, {args.steps} timed steps, "
          f"median of {args.repeats} runs")
    print(f"{'configuration':<34}{'samples/sec':>14}{'vs DDP':>10}")
    for name, rate in rates.items():
        print(f"{name:<34}{rate:>14.1f}{rate / ddp:>9.2f}x")
    print(f"GOAL 3: tensorfleet (overlap on) / DDP: {result['goal3_ratio_to_ddp']:.2f}x (target >= 1.0x)")
    print(f"GOAL 4: overlap on / off: {result['goal4_overlap_gain']:.2f}x")
    print(f"GOAL 6: with bf16 on the wire / DDP: {result['goal6_bf16_ratio_to_ddp']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
