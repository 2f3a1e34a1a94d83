"""One ps shard alone, driven by client processes: how many table ids it looks up and updates per second and per
CPU-second of its own process, with the compiled kernels (``ps/kernels.py``) and with the numpy path; and per
CPU-second of the clients (the worker's side of a step: routing, sending, assembling the rows).

The ps is one process (``Server``, async, one embedding table, Adagrad by default); each of ``--clients``
processes loops for ``--seconds``: a batch of Zipf ids (``--batch`` draws, made unique), a ``Lookup`` of their
rows, then a ``Push`` of one row gradient per id, as a worker's step does with its tables. Before the clock
starts the table is filled to ``--rows`` rows (the timed ids are drawn from those). An "id" below is one id
looked up and pushed. The ps's CPU time is its own, read from ``/proc/<pid>/stat`` at the window's ends; the
two paths run one after the other in the same run, each in a fresh ps (``TENSORFLEET_PS_KERNELS``); the kernel's
accounting of the process, as its rusage.

    python benchmarks/ps_rows.py [--rows 1M] [--dim 16] [--clients 2] [--seconds 10] [--json out.json]

``--rows``, ``--dim`` and ``--clients`` take lists (``--rows 1M,50M --dim 16,64 --clients 1,2,4``: every
combination, a table each); ``--paths numba`` runs the compiled path alone (default: both, for the ratio).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer, TableSpec
from tensorfleet.cluster.ports import local_cluster
from tensorfleet.worker.client import PsClient

TABLE = "t"
FILL_CHUNK = 200_000
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def serve(cluster: dict, path: str) -> None:
    os.environ["TENSORFLEET_PS_KERNELS"] = path
    torch.set_num_threads(1)
    from tensorfleet.ps.server import Server

    Server(ClusterSpec(cluster), job_name="ps", task_index=0).join()


def spec(args: argparse.Namespace) -> TableSpec:
    return TableSpec(TABLE, args.dim, OptimizerSpec(args.rule, {"lr": 0.05}), initializer=RowInitializer.normal(0.01))


def drive(index: int, cluster: dict, args: argparse.Namespace, ready: mp.Barrier, start: mp.Barrier,
          results: mp.Queue) -> None:
    torch.set_num_threads(1)
    client = PsClient(ClusterSpec(cluster), {}, tables=[spec(args)])
    client.wait_for_shards(60)
    rng = np.random.default_rng(index)
    if index == 0:
        client.initialize({}, OptimizerSpec.sgd(lr=0.1))
        for low in range(0, args.rows, FILL_CHUNK):  # every row made before the clock starts
            ids = torch.arange(low, min(low + FILL_CHUNK, args.rows), dtype=torch.int64)
            client.push({}, replica=0, rows={TABLE: (ids, torch.zeros(ids.numel(), args.dim))})
    ready.wait()
    client.wait_initialized(60)
    batches = []
    for _ in range(64):  # made before the clock
        ids = torch.from_numpy(np.unique(rng.zipf(args.zipf, args.batch) % args.rows).astype(np.int64))
        batches.append((ids, torch.from_numpy(rng.standard_normal((ids.numel(), args.dim)).astype(np.float32))))
    start.wait()
    began, ids_done, steps = time.perf_counter(), 0, 0
    cpu_began = time.process_time()
    while time.perf_counter() - began < args.seconds:
        ids, grads = batches[steps % len(batches)]
        client.lookup({TABLE: ids})
        client.push({}, replica=index, rows={TABLE: (ids, grads)})
        ids_done += ids.numel()
        steps += 1
    results.put((ids_done, steps, time.perf_counter() - began, time.process_time() - cpu_began))
    client.done(index)
    client.close()


def run(path: str, args: argparse.Namespace) -> dict:
    cluster = local_cluster(1, args.clients).as_dict()
    context = mp.get_context("spawn")
    ps = context.Process(target=serve, args=(cluster, path), daemon=True)
    ps.start()
    ready, start, results = context.Barrier(args.clients + 1), context.Barrier(args.clients + 1), context.Queue()
    clients = [context.Process(target=drive, args=(i, cluster, args, ready, start, results), daemon=True)
               for i in range(args.clients)]
    for process in clients:
        process.start()
    ready.wait(timeout=1800)  # the table filled
    start.wait(timeout=300)
    cpu_before = cpu_seconds(ps.pid)
    answers = [results.get(timeout=args.seconds + 300) for _ in clients]
    cpu = cpu_seconds(ps.pid) - cpu_before
    for process in clients + [ps]:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    ids = sum(a[0] for a in answers)
    seconds = max(a[2] for a in answers)
    client_cpu = sum(a[3] for a in answers)
    return {"path": path, "ids": ids, "steps": sum(a[1] for a in answers), "seconds": seconds,
            "ids_per_s": ids / seconds, "ps_cpu_s": cpu, "ids_per_cpu_s": ids / cpu if cpu else float("nan"),
            "client_cpu_s": client_cpu, "ids_per_client_cpu_s": ids / client_cpu if client_cpu else float("nan")}


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10 ** 3, "M": 10 ** 6}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KM" else text) * scale)


def listed(parse):
    """An argparse type: a comma-separated list of ``parse``'s values."""
    return lambda text: [parse(item) for item in text.split(",") if item.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=listed(parse_count), default=[parse_count("1M")])
    parser.add_argument("--dim", type=listed(int), default=[16])
    parser.add_argument("--rule", default="adagrad", choices=("sgd", "adagrad", "adam"))
    parser.add_argument("--clients", type=listed(int), default=[2], help="client processes, 1 to 4")
    parser.add_argument("--paths", type=listed(str), default=["numpy", "numba"], help="numba, numpy or both")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=4096, help="Zipf draws per step (made unique)")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of each path")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not all(1 <= clients <= 4 for clients in args.clients) or not set(args.paths) <= {"numpy", "numba"}:
        parser.error("--clients takes 1 to 4 (each); --paths takes numba, numpy or both")
    tables = []
    for rows in args.rows:
        for dim in args.dim:
            for clients in args.clients:
                config = argparse.Namespace(**{**vars(args), "rows": rows, "dim": dim, "clients": clients})
                runs = [run(path, config) for _ in range(args.repeats) for path in args.paths]
                report(config, runs)
                tables.append({"rows": rows, "dim": dim, "clients": clients, "runs": runs})
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "tables": tables}, indent=1) + "\n")
    return 0


def report(config: argparse.Namespace, runs: list[dict]) -> None:
    print(f"one ps, {config.rows:,} rows, dim {config.dim}, {config.rule}, {config.clients} client(s), "
          f"{config.seconds:g} s each, Zipf {config.zipf} ({config.batch} draws a step, made unique)")
    print(f"{'path':<7} {'ids/s':>12} {'ps CPU s':>9} {'ids per ps CPU-s':>17} {'ids per client CPU-s':>21}")
    for r in runs:
        print(f"{r['path']:<7} {r['ids_per_s']:>12,.0f} {r['ps_cpu_s']:>9.1f} {r['ids_per_cpu_s']:>17,.0f} "
              f"{r['ids_per_client_cpu_s']:>21,.0f}")
    best = {path: max(r["ids_per_cpu_s"] for r in runs if r["path"] == path) for path in {r["path"] for r in runs}}
    if len(best) == 2:
        print(f"compiled / numpy, ids per ps CPU-second: {best['numba'] / best['numpy']:.2f}x (target >= 4x)")
    if "numba" in best:
        print(f"compiled: {best['numba']:,.0f} ids per ps CPU-second (target >= 2,000,000 at dim 16, 50M rows)")
    print()


if __name__ == "__main__":
    sys.exit(main())
