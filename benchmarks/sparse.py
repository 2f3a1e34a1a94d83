"""Sparse embedding tables on the ps against one local process and torch DDP: the synthetic click-through job.

The job (``sparse_job.py``): ``CtrSpec.default(N)`` (N distinct ids over four tables: 60 %
users, 30 % items, 10 % tags of 1..5 ids, 0.1 % categories; Zipf popularity, ids are int64
hashes), one table per feature, ``--dim`` 32, the tags bag mean-pooled, a 128-64-32-1 tower,
BCE-with-logits; Adagrad (lr 0.05) on the tables, Adam (lr 1e-3) on the tower.  For each
table size N, in this order:

* **tensorfleet** (ours): ``tensorfleet launch --ps 2 --workers 2`` on 127.0.0.1, async
  (``--sync``: sync), ``EmbeddingTable`` layers: each worker fetches its batch's unique ids'
  rows from the ps and pushes their row gradients (per-row Adagrad on the ps; the ps holds
  only rows ever updated), the tower as ordinary variables;
* **one local process** (the ceiling): ``nn.Embedding(n, dim, sparse=True)`` /
  ``nn.EmbeddingBag(n, dim, mode="mean", sparse=True)`` per table over the ids remapped to
  0..n-1 (each id's Zipf rank, recovered by inverting the generator's hash), sparse
  ``torch.optim.Adagrad`` on the tables, Adam on the tower, doing the steps of both workers;
* **torch DDP** (gloo, 2 processes on 127.0.0.1): the same model with *dense* tables
  (``sparse=False``, what a PyTorch user writes by default): every step all-reduces the whole
  tables' gradients and Adagrad touches every row.  Run for ``--ddp-steps`` (10) only: its
  step time hardly depends on the data, and at 1M ids a step already took ~3.5 s here (dense
  Adagrad over 32 M floats ~0.9 s, backward ~0.3 s, the all-reduce of 128 MB), ~10x that at 10M.

Samples/s: ours = both workers' timed samples / the slower worker's seconds; DDP likewise;
the ceiling = its samples / its seconds.  Batches are generated before the clock starts
(every stack alike), and each stack runs ``--warmup`` untimed steps first.

Bytes/step, per worker (or DDP rank) and step, sent + received: for ours *measured*: the
tensor bytes through the worker's ``DataChannel.call`` (Lookup, Push, Pull; message heads
not counted), wrapped per channel by the job, since the data plane keeps no byte counters;
it equals the formula sum over tables of unique ids x (8 + 4 dim) x 2 (ids and rows for the
lookup, ids and row gradients for the push) + 2 x the tower's bytes.  For DDP a formula: a ring
all-reduce of S bytes over 2 ranks sends S and receives S per rank: 2 S, S = tables + tower.

Memory: each ps reports at exit its peak RSS (``/proc/self/status`` VmHWM) and its heap growth
(the largest RssAnon, sampled every 0.1 s, minus RssAnon before serving: VmHWM also counts
torch's code pages as they are first run, ~0.1 GB a process, which would swamp small tables);
the chief asks every ps's Status for its tables (rows held, bytes).  The second table compares
the heap growth with the bare rows the ps hold (rows x dim x 4 x 2: values and the Adagrad
sum) and with the full-size table the ceiling allocates.  About 75 MB a ps of that growth is
the serving process's own (measured with 3 steps of 64 samples): compare at 10M and up.
A reference that would not fit in the memory available now is skipped, and said so: the
ceiling needs about 2 x N x dim x 4 bytes (weights, Adagrad sum), DDP about 5 x that per
rank (weights, gradient, DDP's bucket copy of it, Adagrad sum, backward's dense buffer).
The default sizes are 1M, 10M and ``max``: the largest multiple of 10M whose ceiling fits in
70 % of the memory available when the script starts.

AUC on held-out batches (a worker index no training process uses), with the Bayes-optimal AUC
of those batches for scale.  Every process runs one intra-op thread.  Batch 4096 per worker
by default: CTR models train on large batches, and at 1024 the per-step fixed costs (a
round trip per table and ps, Python per request) dominate a step of this small tower (at 1M
ids, 2 workers moved ~1.5x the samples/s at 4096 as at 1024 while this was written).

    python benchmarks/sparse.py [--table-sizes 1M,10M,max] [--steps 500] [--batch-size 4096] [--sync]
    python benchmarks/sparse.py --smoke        # 100k ids, a few steps: under a minute
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import sparse_job as job  # noqa: E402
from tensorfleet.data.synthetic_ctr import CtrSpec  # noqa: E402
from tensorfleet.cluster.ports import free_ports  # noqa: E402

GB = 1e9


# --- sizes and memory -----------------------------------------------------------------------------

def parse_size(text: str) -> int | str:
    text = text.strip().lower()
    if text == "max":
        return "max"
    scale = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def ceiling_bytes(n: int, dim: int) -> float:
    """What the ceiling process holds: weights and the Adagrad sum of every row, +15 %, + 0.5 GB of torch."""
    return 2 * n * dim * 4 * 1.15 + 0.5 * GB


def ddp_bytes(n: int, dim: int) -> float:
    """Both DDP ranks: weights, gradient, bucket copy, Adagrad sum, backward's dense buffer each, + 0.5 GB each."""
    return 2 * (5 * n * dim * 4 + 0.5 * GB)


def largest_size(dim: int, available: int) -> int:
    """The largest multiple of 10M ids (1M under 10M) whose ceiling fits in 70 % of ``available``."""
    n = int((0.7 * available - 0.5 * GB) / (2 * dim * 4 * 1.15))
    step = 10_000_000 if n >= 10_000_000 else 1_000_000
    return max(step, n // step * step)


# --- the references (forked children: no second import of torch) ---------------------------------

def in_child(target: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """Run ``target(*args)`` in a forked process (its own peak RSS, memory returned at its end)."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def run() -> None:
        try:
            sender.send(target(*args))
        except BaseException as exc:  # noqa: BLE001 - reported by the parent
            sender.send({"error": f"{type(exc).__name__}: {exc}"})

    process = context.Process(target=run)
    process.start()
    sender.close()
    try:
        result = receiver.recv()
    except EOFError:
        result = {"error": "the process died (out of memory?)"}
    process.join()
    if "error" in result:
        raise RuntimeError(f"{target.__name__}: {result['error']}")
    return result


def ceiling(n: int, a: argparse.Namespace) -> dict[str, Any]:
    """One local process, sparse tables, every step of both workers (their batches interleaved)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # Adagrad's sparse step, per call
    spec = CtrSpec.default(n, seed=a.seed)
    job.check_remap(spec)
    total = a.warmup + a.steps
    data = [b for step in range(total) for worker in (0, 1)
            for b in job.make_batches(spec, worker=worker, steps=[step], batch_size=a.batch_size, remap=True)]
    torch.manual_seed(a.seed)
    model = job.local_model(spec, a.dim, sparse=True, seed=a.seed)
    tables = torch.optim.Adagrad(model.tables.parameters(), lr=a.table_lr)
    tower = torch.optim.Adam(model.tower.parameters(), lr=a.dense_lr)
    for i, batch in enumerate(data):
        if i == 2 * a.warmup:
            start = time.perf_counter()
        tables.zero_grad(set_to_none=True)
        tower.zero_grad(set_to_none=True)
        job.loss_of(model, batch).backward()
        tables.step()
        tower.step()
    elapsed = time.perf_counter() - start
    held, bayes = job.held_out(spec, a.eval_batches, a.batch_size, remap=True)
    samples = 2 * a.steps * a.batch_size
    return {"seconds": elapsed, "samples": samples, "samples_per_sec": samples / elapsed,
            "samples_trained": 2 * total * a.batch_size, "auc": job.evaluate(model, held), "bayes_auc": bayes,
            "peak_rss": job.proc_status_kb("VmHWM"), "bytes_per_step": 0.0}


def ddp_rank(rank: int, port: int, n: int, a: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    try:
        spec = CtrSpec.default(n, seed=a.seed)
        data = job.make_batches(spec, worker=rank, steps=range(a.ddp_warmup + a.ddp_steps),
                                batch_size=a.batch_size, remap=True)
        torch.manual_seed(a.seed)
        module = job.local_model(spec, a.dim, sparse=False, seed=a.seed)
        model = nn.parallel.DistributedDataParallel(module)
        tables = torch.optim.Adagrad(module.tables.parameters(), lr=a.table_lr)
        tower = torch.optim.Adam(module.tower.parameters(), lr=a.dense_lr)
        for step, batch in enumerate(data):
            if step == a.ddp_warmup:
                dist.barrier()
                start = time.perf_counter()
            tables.zero_grad(set_to_none=True)
            tower.zero_grad(set_to_none=True)
            job.loss_of(model, batch).backward()
            tables.step()
            tower.step()
        dist.barrier()
        elapsed = time.perf_counter() - start
        result: dict[str, Any] = {"seconds": elapsed, "peak_rss": job.proc_status_kb("VmHWM")}
        if rank == 0:
            held, bayes = job.held_out(spec, a.eval_batches, a.batch_size, remap=True)
            result.update(auc=job.evaluate(module, held), bayes_auc=bayes)
        return result
    finally:
        dist.destroy_process_group()


def ddp(n: int, a: argparse.Namespace) -> dict[str, Any]:
    port = free_ports(1)[0]
    context = multiprocessing.get_context("fork")
    with context.Pool(2) as pool:  # noqa: SIM117
        ranks = pool.starmap(ddp_rank_safe, [(r, port, n, a) for r in range(2)])
    for r in ranks:
        if "error" in r:
            raise RuntimeError(f"DDP: {r['error']}")
    seconds = max(r["seconds"] for r in ranks)
    samples = 2 * a.ddp_steps * a.batch_size
    params = sum(t.num_ids for t in CtrSpec.default(n, seed=a.seed).tables) * a.dim + tower_parameters(a.dim)
    return {"seconds": seconds, "samples": samples, "samples_per_sec": samples / seconds,
            "samples_trained": 2 * (a.ddp_warmup + a.ddp_steps) * a.batch_size,
            "auc": ranks[0]["auc"], "bayes_auc": ranks[0]["bayes_auc"],
            "peak_rss": max(r["peak_rss"] for r in ranks), "peak_rss_per_rank": [r["peak_rss"] for r in ranks],
            "bytes_per_step": 2.0 * params * 4, "bytes_formula": "2 x (tables + tower) fp32 bytes per rank"}


def ddp_rank_safe(*args: Any) -> dict[str, Any]:
    try:
        return ddp_rank(*args)
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        return {"error": f"{type(exc).__name__}: {exc}"}


def tower_parameters(dim: int) -> int:
    width, total = 4 * dim, 0
    for hidden in (*job.HIDDEN, 1):
        total += width * hidden + hidden
        width = hidden
    return total


# --- ours -----------------------------------------------------------------------------------------

def ours(n: int, a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sparse-bench-") as tmp:
        results = Path(tmp)
        command = [sys.executable, "-m", "tensorfleet.cli", "launch", "--ps", "2", "--workers", "2",
                   "--restart", "never", "--logdir", str(results / "logs"), "--progress-every", "3600",
                   "--sync" if a.sync else "--async", str(HERE / "sparse_job.py"), "--",
                   "--table_size", str(n), "--dim", str(a.dim), "--batch_size", str(a.batch_size),
                   "--steps", str(a.steps), "--warmup", str(a.warmup), "--eval_batches", str(a.eval_batches),
                   "--table_lr", str(a.table_lr), "--dense_lr", str(a.dense_lr), "--seed", str(a.seed),
                   "--result_dir", str(results)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode:
            raise RuntimeError(f"the job failed:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}")
        workers = [json.loads((results / f"worker-{i}.json").read_text()) for i in range(2)]
        ps = [json.loads((results / f"ps-{i}.json").read_text()) for i in range(2)]
    chief = workers[0]
    samples = sum(w["samples"] for w in workers)
    seconds = max(w["seconds"] for w in workers)
    sent = statistics.mean(w["bytes_sent_per_step"] for w in workers)
    received = statistics.mean(w["bytes_received_per_step"] for w in workers)
    unique = {name: statistics.mean(w["unique_ids_per_step"][name] for w in workers)
              for name in chief["unique_ids_per_step"]}
    formula = sum(unique.values()) * (8 + 4 * a.dim) * 2 + 2 * chief["dense_parameter_bytes"]
    tables = [s["tables"] for s in chief["ps_status"]]
    rows = sum(t["rows"] for shard in tables for t in shard.values())
    bare = sum(t["rows"] * t["bytes_per_row_bare"] for shard in tables for t in shard.values())
    held = sum(t["bytes"] for shard in tables for t in shard.values())
    mode = "sync" if a.sync else "async"
    return {"seconds": seconds, "samples": samples, "samples_per_sec": samples / seconds,
            "samples_trained": samples + 2 * a.warmup * a.batch_size, "mode": mode,
            "auc": chief["auc"], "bayes_auc": chief["bayes_auc"], "global_step": chief["global_step"],
            "bytes_per_step": sent + received, "bytes_sent_per_step": sent, "bytes_received_per_step": received,
            "bytes_formula_per_step": formula, "unique_ids_per_step": unique,
            "by_method": chief["by_method"], "worker_peak_rss": [w["peak_rss"] for w in workers],
            "ps_peak_rss": [p["peak_rss"] for p in ps], "ps_rss_before_serving": [p["rss_before_serving"] for p in ps],
            "ps_heap_growth": [p["anon_peak_sampled"] - p["anon_before_serving"] for p in ps],
            "ps_rows": rows, "ps_bare_bytes": bare, "ps_table_bytes": held, "ps_tables": tables,
            "peak_rss": max(p["peak_rss"] for p in ps)}


# --- the driver -----------------------------------------------------------------------------------

def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median samples/s (the lower middle of an even count), with every run's rate."""
    ordered = sorted(runs, key=lambda r: r["samples_per_sec"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["samples_per_sec_runs"] = [r["samples_per_sec"] for r in runs]
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--table-sizes", default="1M,10M,max",
                        help="distinct ids over all tables, comma-separated (100k, 1M, 2.5M, max)")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4096, help="per worker (and per DDP rank)")
    parser.add_argument("--steps", type=int, default=500, help="timed steps per worker (the ceiling does 2x)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per worker first")
    parser.add_argument("--ddp-steps", type=int, default=10,
                        help="timed DDP steps per rank (a step at 10M ids moves ~2.6 GB a rank and takes tens of s)")
    parser.add_argument("--ddp-warmup", type=int, default=2)
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches for the AUC")
    parser.add_argument("--table-lr", type=float, default=0.05, help="Adagrad on the tables")
    parser.add_argument("--dense-lr", type=float, default=1e-3, help="Adam on the tower")
    parser.add_argument("--seed", type=int, default=0, help="the synthetic world")
    parser.add_argument("--sync", action="store_true", help="ours in sync mode (default async)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of each configuration")
    parser.add_argument("--only", nargs="+", choices=("ours", "ceiling", "ddp"), default=["ours", "ceiling", "ddp"])
    parser.add_argument("--smoke", action="store_true",
                        help="100k ids, batch 1024, 30 steps (10 for DDP): checks the whole script in under a minute")
    parser.add_argument("--json", default=None)
    a = parser.parse_args()
    if a.smoke:
        a.table_sizes, a.batch_size, a.steps, a.warmup = "100k", 1024, 30, 5
        a.ddp_steps, a.ddp_warmup, a.eval_batches = 10, 2, 2
    available = mem_available()
    sizes: list[int] = []
    for text in a.table_sizes.split(","):
        size = parse_size(text)
        size = largest_size(a.dim, available) if size == "max" else size
        if size not in sizes:
            sizes.append(size)

    runners: dict[str, Callable[[int], dict[str, Any]]] = {
        "ours": lambda n: ours(n, a), "ceiling": lambda n: in_child(ceiling, n, a), "ddp": lambda n: ddp(n, a)}
    needs = {"ceiling": ceiling_bytes, "ddp": ddp_bytes}
    results: dict[int, dict[str, Any]] = {}
    for n in sizes:
        results[n] = {}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in a.only}
        for round_ in range(a.repeats):  # interleaved: every stack sees the same state of the machine
            for name in a.only:
                if name in needs:
                    need, free = needs[name](n, a.dim), mem_available()
                    if need > 0.8 * free:
                        results[n][name] = {"skipped": f"needs ~{need / GB:.1f} GB, {free / GB:.1f} GB available"}
                        print(f"{human(n)} ids: {name} skipped ({results[n][name]['skipped']})", flush=True)
                        continue
                began = time.perf_counter()
                runs[name].append(runners[name](n))
                print(f"{human(n)} ids, round {round_ + 1}: {name} {runs[name][-1]['samples_per_sec']:,.0f} samples/s "
                      f"({time.perf_counter() - began:.0f} s with start-up)", flush=True)
        for name, done in runs.items():
            if done:
                results[n][name] = median_run(done)
    report(results, a)
    if a.json:
        Path(a.json).write_text(json.dumps({"arguments": vars(a), "memory_available": available,
                                            "results": {str(n): r for n, r in results.items()}}, indent=2) + "\n")
    return 0


def report(results: dict[int, dict[str, Any]], a: argparse.Namespace) -> None:
    mode = "sync" if a.sync else "async"
    labels = {"ours": f"tensorfleet, 2 ps + 2 {mode} workers", "ceiling": "one local process, sparse (ceiling)",
              "ddp": "torch DDP gloo, 2 ranks, dense tables"}
    print(f"\nSynthetic CTR, dim {a.dim}, batch {a.batch_size} per worker, {a.steps} timed steps per worker "
          f"(DDP {a.ddp_steps}), one thread per process, median of {a.repeats} round(s)")
    print(f"{'ids':>6}  {'run':<38}{'samples/s':>11}{'bytes/step':>12}{'ours is':>9}{'AUC':>8}"
          f"{'trained on':>12}{'peak RSS':>10}")
    for n, runs in results.items():
        mine = runs.get("ours", {}).get("samples_per_sec")
        for name in ("ours", "ceiling", "ddp"):
            run = runs.get(name)
            if run is None:
                continue
            if "skipped" in run:
                print(f"{human(n):>6}  {labels[name]:<38}  skipped: {run['skipped']}")
                continue
            ratio = f"{mine / run['samples_per_sec']:.2f}x" if mine else "-"
            moved = f"{run['bytes_per_step'] / 1e6:.2f} MB" if run["bytes_per_step"] else "-"
            print(f"{human(n):>6}  {labels[name]:<38}{run['samples_per_sec']:>11,.0f}{moved:>12}{ratio:>9}"
                  f"{run['auc']:>8.4f}{human(run['samples_trained']):>12}{run['peak_rss'] / GB:>8.2f} GB")
    bayes = next((r["bayes_auc"] for runs in results.values() for r in runs.values() if "bayes_auc" in r), None)
    if bayes is not None:
        print(f"AUC on {a.eval_batches} held-out batches; the Bayes-optimal AUC there is about {bayes:.3f}, "
              "a constant 0.5.")
    print("bytes/step: per worker (DDP: per rank) and step, sent + received. tensorfleet: measured, tensor bytes "
          "through each worker's DataChannel.call, wrapped by the job since the data plane keeps no byte counters "
          "(heads not counted); DDP: the formula 2 x (tables + tower) x 4 bytes "
          "(ring all-reduce, 2 ranks); the ceiling moves none. peak RSS: tensorfleet: the larger ps; "
          "the ceiling: its process; DDP: the larger rank.")
    if any("ours" in runs and "skipped" not in runs["ours"] for runs in results.values()):
        print(f"\n{'ids':>6}  {'ps peak RSS':>12}{'heap growth':>13}{'rows held':>11}{'bare rows':>11}"
              f"{'held':>10}{'growth/bare':>13}{'full table':>12}{'measured = formula':>20}")
        for n, runs in results.items():
            run = runs.get("ours")
            if not run or "skipped" in run:
                continue
            growth = sum(run["ps_heap_growth"])
            full = n * a.dim * 4 * 2
            same = abs(run["bytes_per_step"] - run["bytes_formula_per_step"]) <= 0.001 * run["bytes_per_step"]
            print(f"{human(n):>6}  {sum(run['ps_peak_rss']) / GB:>9.2f} GB{growth / GB:>10.3f} GB"
                  f"{human(run['ps_rows']):>11}{run['ps_bare_bytes'] / GB:>8.3f} GB"
                  f"{run['ps_table_bytes'] / GB:>7.3f} GB"
                  f"{growth / max(run['ps_bare_bytes'], 1):>12.1f}x{full / GB:>9.2f} GB"
                  f"{'yes' if same else 'no: ' + human(run['bytes_formula_per_step']):>20}")
        print("Both ps together. ps peak RSS: VmHWM (counts torch's code pages as they are first run, ~0.1 GB a "
              "process); heap growth: the largest RssAnon sampled every 0.1 s - RssAnon before serving; bare rows: "
              "rows held x dim x 4 x 2 (values, Adagrad sum); held: what the ps's Status says its tables hold "
              "(storage with room to grow, id map; about 75 MB a ps of the heap growth is the serving process's own, "
              "measured with 3 steps of 64 samples); full table: every id's row and Adagrad sum, what the ceiling "
              "allocates. measured = formula: bytes/step against unique ids x (8 + 4 dim) x 2 + 2 x tower bytes.")

if __name__ == "__main__":
    sys.exit(main())
