"""Hybrid mode (issue 40): dense parameters by all-reduce, tables on the ps, against all-on-ps and torch DDP.

Two jobs, each a set of configurations run interleaved (``--repeats`` rounds), 2 workers on this machine
(``--workers``), one intra-op thread per process, synthetic data made before the clock starts:

* **dense**: ``vs_ddp.py``'s MLP of 15.8 M parameters, batch 64 per worker, SGD with momentum, sync:
  torch DDP (gloo, bucketed, overlapped) / tensorfleet with every variable on 2 ps (overlap on:
  classic mode) / tensorfleet hybrid (``dense="allreduce"``: the same gloo all-reduce, 1 ps keeping the
  global step only);
* **ctr**: a click-through model, one ``EmbeddingTable`` of ``--ids`` ids (dim 16, 8 ids per sample, summed)
  and an MLP 16-256-64-1, batch ``--ctr-batch`` per worker, BCE, async, Adagrad on the rows, Adam on the MLP:
  tensorfleet all-on-ps (table and MLP on 2 ps) / hybrid (MLP by all-reduce, table on 2 ps; Persia's mode:
  rows async, dense sync) / torch DDP with the table as a dense ``nn.EmbeddingBag`` (what a PyTorch user
  writes; every step reduces the whole table) / one local process with a sparse table doing both workers'
  samples (the ceiling, no communication at all).

Samples/s = all workers' timed samples / the slowest worker's seconds; a configuration's figure is the
median of its rounds. Over TCP: tensorfleet's data plane uses loopback TCP (``TENSORFLEET_SHARED_MEMORY=0``),
as gloo does, for the dense job's comparison with DDP; ``--shared-memory`` lets the ps use shared memory.

    python benchmarks/hybrid.py [--jobs dense,ctr] [--steps 20] [--repeats 3] [--json hybrid.json]
    python benchmarks/hybrid.py --smoke          # tiny sizes, one round: a check that every path runs
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tensorfleet as tfl  # noqa: E402
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec  # noqa: E402
from tensorfleet.cluster.ports import free_ports, local_cluster  # noqa: E402
from tensorfleet.wire.rpc import SHARED_MEMORY_ENV  # noqa: E402
from vs_ddp import LR, MOMENTUM, ps_processes  # noqa: E402
from vs_ddp import batch as dense_batch  # noqa: E402
from vs_ddp import build_model as dense_model  # noqa: E402

WARMUP = 3
CTR_DIM, CTR_IDS_PER_SAMPLE = 16, 8


# --- the models ---------------------------------------------------------------------------------------

class Ctr(nn.Module):
    """One table (on the ps as an EmbeddingTable, or a local EmbeddingBag) and the MLP head."""

    def __init__(self, num_ids: int, *, table: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Sequential(nn.Linear(CTR_DIM, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))
        if table == "fleet":
            self.table: nn.Module = tfl.EmbeddingTable("ids", CTR_DIM, num_rows=num_ids, pooling="sum",
                                                       optimizer=tfl.OptimizerSpec("adagrad", {"lr": 0.05}))
        else:
            self.table = nn.EmbeddingBag(num_ids, CTR_DIM, mode="sum", sparse=table == "sparse")
            nn.init.normal_(self.table.weight, std=0.01)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids)).squeeze(1)


def ctr_batches(num_ids: int, batch_size: int, worker: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + worker)
    out = []
    for _ in range(count):
        ids = torch.randint(0, num_ids, (batch_size, CTR_IDS_PER_SAMPLE), generator=generator)
        out.append((ids, (ids[:, 0] % 7 == 0).float()))  # a learnable label: some ids click
    return out


# --- one worker's timed steps (a subprocess each: --role) -------------------------------------------------

def fleet_worker(args: argparse.Namespace) -> float:
    cluster = ClusterSpec.from_dict(json.loads(args.cluster))
    task = TaskSpec("worker", args.index)
    if args.job == "dense":
        model = dense_model()
        replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.sgd(lr=LR, momentum=MOMENTUM),
                              mode="sync", dense=args.dense, overlap=args.dense == "ps",
                              placement=tfl.GreedyByBytes(),
                              partitioner=tfl.RowPartitioner(num_parts=2, min_bytes=1 << 20))
        x, y = dense_batch(args.index)
        data = [(x, y)] * (WARMUP + args.steps)
        loss = lambda b: nn.functional.cross_entropy(model(b[0]), b[1])  # noqa: E731
    else:
        model = Ctr(args.ids, table="fleet")
        replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.adam(lr=1e-3), dense=args.dense)
        data = ctr_batches(args.ids, args.ctr_batch, args.index, WARMUP + args.steps)
        loss = lambda b: nn.functional.binary_cross_entropy_with_logits(model(b[0]), b[1])  # noqa: E731
    with replica:
        for step, batch in enumerate(data):
            if step == WARMUP:
                start = time.perf_counter()
            replica.pull()
            loss(batch).backward()
            replica.push()
        replica.settle()
        return time.perf_counter() - start


def ddp_worker(args: argparse.Namespace) -> float:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", world_size=args.workers,
                            rank=args.index)
    if args.job == "dense":
        model = nn.parallel.DistributedDataParallel(dense_model())
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        x, y = dense_batch(args.index)
        data = [(x, y)] * (WARMUP + args.steps)
        loss = lambda b: nn.functional.cross_entropy(model(b[0]), b[1])  # noqa: E731
    else:
        local = Ctr(args.ids, table="dense")
        model = nn.parallel.DistributedDataParallel(local)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        data = ctr_batches(args.ids, args.ctr_batch, args.index, WARMUP + args.steps)
        loss = lambda b: nn.functional.binary_cross_entropy_with_logits(model(b[0]), b[1])  # noqa: E731
    for step, batch in enumerate(data):
        if step == WARMUP:
            dist.barrier()
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss(batch).backward()
        optimizer.step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    return elapsed


def local_ctr(args: argparse.Namespace) -> float:
    """The ceiling: one process, a sparse local table, every worker's batches one after another."""
    model = Ctr(args.ids, table="sparse")
    sparse = torch.optim.SparseAdam(list(model.table.parameters()), lr=1e-3)
    dense = torch.optim.Adam(model.head.parameters(), lr=1e-3)
    data = [b for w in range(args.workers) for b in ctr_batches(args.ids, args.ctr_batch, w, WARMUP + args.steps)]
    for step, (ids, labels) in enumerate(data):
        if step == WARMUP * args.workers:
            start = time.perf_counter()
        sparse.zero_grad()
        dense.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(ids), labels).backward()
        sparse.step()
        dense.step()
    return time.perf_counter() - start


# --- the driver -----------------------------------------------------------------------------------------

def run_roles(argvs: list[list[str]], env: dict[str, str]) -> float:
    """One process per argv (this script, --role ...); the slowest one's timed seconds."""
    processes = [subprocess.Popen([sys.executable, __file__, *argv], stdout=subprocess.PIPE, text=True, env=env)
                 for argv in argvs]
    try:
        return max(float(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in processes)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()


def common(args: argparse.Namespace, job: str) -> list[str]:
    return ["--job", job, "--steps", str(args.steps), "--ids", str(args.ids), "--ctr-batch", str(args.ctr_batch),
            "--workers", str(args.workers)]


def run_fleet(args: argparse.Namespace, job: str, dense: str, num_ps: int) -> float:
    cluster = local_cluster(num_ps, args.workers)
    env = {**os.environ, "OMP_NUM_THREADS": "1", SHARED_MEMORY_ENV: "1" if args.shared_memory else "0"}
    with ps_processes(cluster, env):
        spec = json.dumps(cluster.as_dict())
        return run_roles([["--role", "fleet", "--cluster", spec, "--index", str(i), "--dense", dense,
                           *common(args, job)] for i in range(args.workers)], env)


def run_ddp(args: argparse.Namespace, job: str) -> float:
    port = free_ports(1)[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_roles([["--role", "ddp", "--port", str(port), "--index", str(i), *common(args, job)]
                      for i in range(args.workers)], env)


def configurations(args: argparse.Namespace, job: str) -> dict[str, callable]:
    if job == "dense":
        return {"DDP (gloo)": lambda: run_ddp(args, job),
                "all on the ps (2 ps, overlap)": lambda: run_fleet(args, job, "ps", 2),
                "hybrid (dense by all-reduce)": lambda: run_fleet(args, job, "allreduce", 1)}
    return {"all on the ps (2 ps)": lambda: run_fleet(args, job, "ps", 2),
            "hybrid (dense by all-reduce, table on 2 ps)": lambda: run_fleet(args, job, "allreduce", 2),
            "DDP, dense table": lambda: run_ddp(args, job),
            "one local process, sparse table": lambda: run_roles([["--role", "local", *common(args, job)]],
                                                                 {**os.environ, "OMP_NUM_THREADS": "1"})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--jobs", default="dense,ctr")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ids", type=int, default=1_000_000, help="the click-through table's ids")
    parser.add_argument("--ctr-batch", type=int, default=4096)
    parser.add_argument("--shared-memory", action="store_true", help="tensorfleet's bodies through shared memory")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    parser.add_argument("--json", default=None)
    parser.add_argument("--role", choices=["fleet", "ddp", "local"], help=argparse.SUPPRESS)
    parser.add_argument("--job", choices=["dense", "ctr"], help=argparse.SUPPRESS)
    parser.add_argument("--dense", default="ps", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.role:
        print({"fleet": fleet_worker, "ddp": ddp_worker, "local": local_ctr}[args.role](args))
        return 0
    if args.smoke:
        args.steps, args.repeats, args.ids, args.ctr_batch = 3, 1, 10_000, 256

    result: dict = {"steps": args.steps, "repeats": args.repeats, "workers": args.workers,
                    "over": "shared memory" if args.shared_memory else "TCP", "jobs": {}}
    for job in args.jobs.split(","):
        runs: dict[str, list[float]] = {name: [] for name in configurations(args, job)}
        per_step = args.ctr_batch if job == "ctr" else 64
        samples = args.workers * per_step * args.steps
        for _ in range(args.repeats):  # interleaved: a drifting load hits every configuration alike
            for name, run in configurations(args, job).items():
                runs[name].append(samples / run())
        rates = {name: statistics.median(values) for name, values in runs.items()}
        reference = rates["DDP (gloo)"] if job == "dense" else rates["all on the ps (2 ps)"]
        result["jobs"][job] = {"samples_per_sec": rates, "runs": runs,
                               "ratios": {name: rate / reference for name, rate in rates.items()}}
        what = ("MLP of 15.8 M parameters, batch 64 per worker, sync" if job == "dense" else
                f"click-through: {args.ids:,} ids x dim {CTR_DIM}, batch {args.ctr_batch} per worker, async")
        print(f"\n{job}: {what}; {args.workers} workers, {args.steps} timed steps, median of {args.repeats}, "
              f"tensorfleet over {result['over']}")
        print(f"{'configuration':<46}{'samples/s':>12}{'ratio':>9}")
        for name, rate in rates.items():
            print(f"{name:<46}{rate:>12.1f}{rate / reference:>8.2f}x")
        print(f"(ratios to {'DDP' if job == 'dense' else 'all on the ps'})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
