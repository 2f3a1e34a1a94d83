"""The synthetic click-through job of ``sparse.py``, as ``tensorfleet launch`` runs it (every ps and worker task).

    tensorfleet launch --ps 2 --workers 2 benchmarks/sparse_job.py -- --table_size 1000000 --result_dir DIR

The model: one table per feature of ``CtrSpec.default(table_size)`` (user, item, category:
one id per sample; tags: a bag of 1..5 ids, mean-pooled), ``--dim`` floats a row, then a
small MLP tower (4 x dim -> 64 -> 32 -> 1) on the concatenated rows, BCE-with-logits loss.
The tables are ``EmbeddingTable`` layers (rows on the ps by int64 id, per-row Adagrad there),
the tower's parameters are ordinary variables (Adam on the ps).  ``sparse.py`` builds the
same model from ``nn.Embedding`` / ``nn.EmbeddingBag`` for its references (``build_model``).

Each worker generates its batches before the clock starts (``CtrSpec``'s batches are a pure
function of (worker, step)), runs ``--warmup`` untimed steps, then ``--steps`` timed ones
(pull, forward with the tables' lookups, backward, push).  It counts the tensor bytes its
data channels send and receive during the timed steps (every Lookup, Push and Pull goes
through ``DataChannel.call``; message heads are not counted), and writes
``RESULT_DIR/worker-<i>.json``.  The chief then waits for the other worker, evaluates the
AUC on held-out batches (rows looked up on the ps) and adds every ps's Status (``tables``:
rows, bytes).  Each ps writes ``RESULT_DIR/ps-<i>.json`` when it exits: its peak RSS (VmHWM),
its RSS before it served (imports done), and its anonymous memory (RssAnon: heap, the tables)
before serving and at its largest, sampled every 0.1 s (VmHWM also counts torch's code pages
as they are first run, ~100 MB per process here, which would swamp small tables).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.data.synthetic_ctr import CtrSpec, batch as ctr_batch, mix64
from tensorfleet.protocol.specs import OptimizerSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from click_through import HIDDEN, Batch, CtrModel, as_batch, evaluate, fleet_model  # noqa: E402 - the example's model
from click_through import held_out as held_out_raw  # noqa: E402

INIT_STD = 0.01  # every table's rows start N(0, 0.01^2), on the ps (RowInitializer's default) and locally
__all__ = ["HIDDEN", "evaluate"]  # used by sparse.py through this module


def local_model(spec: CtrSpec, dim: int, *, sparse: bool, seed: int = 0) -> CtrModel:
    """The model with full-size local tables over ids remapped to 0..num_ids-1 (``remap``):
    ``nn.Embedding`` / ``nn.EmbeddingBag(mode="mean")``, sparse or dense gradients."""
    tables: dict[str, nn.Module] = {}
    for t in spec.tables:
        table = (nn.EmbeddingBag(t.num_ids, dim, mode="mean", sparse=sparse) if t.ids_per_sample > 1
                 else nn.Embedding(t.num_ids, dim, sparse=sparse))
        with torch.no_grad():
            table.weight.normal_(0.0, INIT_STD)
        tables[t.name] = table
    return CtrModel(spec, dim, tables, seed=seed)


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    features, labels = batch
    return nn.functional.binary_cross_entropy_with_logits(model(features), labels)


# --- data -----------------------------------------------------------------------------------------

_M1_INV = np.uint64(pow(0xBF58476D1CE4E5B9, -1, 2 ** 64))
_M2_INV = np.uint64(pow(0x94D049BB133111EB, -1, 2 ** 64))


def unmix64(x: np.ndarray) -> np.ndarray:
    """The inverse of ``synthetic_ctr.mix64`` (splitmix64's finalizer) on uint64."""
    s = {n: np.uint64(n) for n in (27, 30, 31, 54, 60, 62)}
    with np.errstate(over="ignore"):
        x = x ^ (x >> s[31]) ^ (x >> s[62])
        x = x * _M2_INV
        x = x ^ (x >> s[27]) ^ (x >> s[54])
        x = x * _M1_INV
        return x ^ (x >> s[30]) ^ (x >> s[60])


def rows_of_ids(spec: CtrSpec, table: str, ids: np.ndarray) -> np.ndarray:
    """The synthetic int64 ids of ``table`` as rows 0..num_ids-1 (Zipf rank - 1): ids are
    ``mix64(rank + salt)``, so ``rank = unmix64(id) - salt``."""
    with np.errstate(over="ignore"):
        return (unmix64(ids.view(np.uint64)) - np.uint64(spec.salt(table))).astype(np.int64) - 1


def check_remap(spec: CtrSpec) -> None:
    from tensorfleet.data.synthetic_ctr import ids_of_ranks
    for t in spec.tables:
        ranks = np.unique(np.r_[1, t.num_ids, np.linspace(1, t.num_ids, 97).astype(np.int64)])
        back = rows_of_ids(spec, t.name, ids_of_ranks(spec, t.name, ranks))
        assert np.array_equal(back, ranks - 1), f"remap of table {t.name} is not the rank"
    assert np.array_equal(unmix64(mix64(np.arange(1000, dtype=np.uint64))), np.arange(1000, dtype=np.uint64))


def make_batches(spec: CtrSpec, *, worker: int, steps: Iterable[int], batch_size: int,
                 remap: bool) -> list[Batch]:
    """The batches of ``worker`` at ``steps`` as tensors; ``remap``: ids as rows 0..num_ids-1."""
    ids_of = (lambda name, ids: rows_of_ids(spec, name, ids)) if remap else (lambda name, ids: ids)
    return [as_batch(ctr_batch(spec, worker=worker, step=step, batch_size=batch_size), ids_of) for step in steps]


def held_out(spec: CtrSpec, batches: int, batch_size: int, *, remap: bool) -> tuple[list[Batch], float]:
    """The held-out batches, and the Bayes-optimal AUC on them (that of the hidden true logits)."""
    raw, bayes = held_out_raw(spec, batches, batch_size)
    ids_of = (lambda name, ids: rows_of_ids(spec, name, ids)) if remap else (lambda name, ids: ids)
    return [as_batch(b, ids_of) for b in raw], bayes


def unique_ids(batch: Batch) -> dict[str, int]:
    return {name: int(torch.unique(ids).numel()) for name, (ids, _) in batch[0].items()}


# --- memory ---------------------------------------------------------------------------------------

def proc_status_kb(field: str, pid: int | str = "self") -> int:
    """A ``kB`` field of /proc/<pid>/status (VmHWM: peak RSS, VmRSS: now), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


# --- the job (every task) -------------------------------------------------------------------------

class ByteCounter:
    """Tensor bytes sent and received through data channels (their ``call``, wrapped per instance)."""

    def __init__(self) -> None:
        self.sent = self.received = 0
        self.by_method: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def wrap(self, channel: Any) -> None:
        call = channel.call

        def counted(method: str, meta: Any = None, tensors: Mapping[str, torch.Tensor] | None = None,
                    **kwargs: Any) -> Any:
            reply = call(method, meta, tensors, **kwargs)
            out = sum(t.numel() * t.element_size() for t in (tensors or {}).values())
            back = sum(t.numel() * t.element_size() for t in reply[1].values())
            with self._lock:
                self.sent += out
                self.received += back
                totals = self.by_method.setdefault(method, [0, 0, 0])
                totals[0] += 1
                totals[1] += out
                totals[2] += back
            return reply

        channel.call = counted

    def reset(self) -> None:
        with self._lock:
            self.sent = self.received = 0
            self.by_method = {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tfl.add_cluster_flags(parser)
    tfl.add_training_flags(parser)
    parser.add_argument("--table_size", type=int, required=True, help="distinct ids over all tables")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=500, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per worker first")
    parser.add_argument("--eval_batches", type=int, default=8)
    parser.add_argument("--table_lr", type=float, default=0.05)
    parser.add_argument("--dense_lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="the synthetic world (CtrSpec seed)")
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--per_table_lookups", action="store_true",
                        help="let each table's forward fetch its own rows (no Replica.prefetch_rows)")
    return parser.parse_args(argv)


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    spec = CtrSpec.default(args.table_size, seed=args.seed)
    replica_id = cluster.replica_id(task)
    data = make_batches(spec, worker=replica_id, steps=range(args.warmup + args.steps),
                        batch_size=args.batch_size, remap=False)
    model = fleet_model(spec, args.dim, args.table_lr)
    replica = tfl.Replica(model, cluster, task, optimizer=OptimizerSpec.adam(lr=args.dense_lr),
                          **tfl.training_options(args))
    counter = ByteCounter()
    for channel in replica.client.data:
        counter.wrap(channel)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    uniques: dict[str, int] = {t.name: 0 for t in spec.tables}
    result: dict[str, Any] = {"task": task.name, "replica": replica_id, "mode": replica.mode.value}
    with replica:
        for step, batch in enumerate(data):
            if step == args.warmup:
                counter.reset()
                start = time.perf_counter()
            if step >= args.warmup:
                for name, count in unique_ids(batch).items():
                    uniques[name] += count
            replica.pull()
            if not args.per_table_lookups:  # every table's rows in one request per shard
                replica.prefetch_rows({name: ids for name, (ids, _) in batch[0].items()})
            loss_of(model, batch).backward()
            replica.push()
        elapsed = time.perf_counter() - start
        result.update(seconds=elapsed, steps=args.steps, samples=args.steps * args.batch_size,
                      samples_per_sec=args.steps * args.batch_size / elapsed,
                      bytes_sent_per_step=counter.sent / args.steps,
                      bytes_received_per_step=counter.received / args.steps,
                      by_method={m: [c / args.steps for c in v] for m, v in counter.by_method.items()},
                      unique_ids_per_step={n: c / args.steps for n, c in uniques.items()},
                      dense_parameter_bytes=dense_bytes, peak_rss=proc_status_kb("VmHWM"))
        if replica.is_chief:
            # Wait for the other workers' last pushes, so the model evaluated has seen every sample.
            total = args.warmup + args.steps
            target = total * (len(cluster.replicas) if replica.mode.value == "async" else 1)
            deadline = time.monotonic() + 600
            while replica.client.global_step() < target and time.monotonic() < deadline:
                time.sleep(0.05)
            replica.pull()
            batches, bayes = held_out(spec, args.eval_batches, args.batch_size, remap=False)
            result.update(auc=evaluate(model, batches), bayes_auc=bayes, global_step=replica.pull(),
                          ps_status=[{"task": s.task, "pid": s.pid, "applied_updates": s.applied_updates,
                                      "tables": {name: counts.to_meta() for name, counts in (s.tables or {}).items()}}
                                     for s in replica.client.wait_for_shards(60)])
    out = Path(args.result_dir) / f"worker-{task.index}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    importlib.import_module("tensorfleet.ps.server")  # the ps's imports, in its baseline RSS
    baseline, anon_baseline = proc_status_kb("VmRSS"), proc_status_kb("RssAnon")
    _, task = tfl.cluster_from_flags(args)
    sampler = HeapSampler() if task.job_name == "ps" else None
    code = tfl.run_task(args, train, intra_op_threads=1)
    if sampler is not None:
        out = Path(args.result_dir) / f"ps-{task.index}.json"
        out.write_text(json.dumps({"task": task.name, "peak_rss": proc_status_kb("VmHWM"),
                                   "rss_before_serving": baseline, "anon_before_serving": anon_baseline,
                                   "anon_peak_sampled": sampler.peak, "rss_at_exit": proc_status_kb("VmRSS"),
                                   "anon_at_exit": proc_status_kb("RssAnon")}) + "\n")
    return code


class HeapSampler:
    """The largest RssAnon (heap and anonymous mappings: the tables, not torch's code pages, which VmHWM
    also counts) seen every ``period_s`` on a daemon thread: a lower bound of the true peak."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.peak = proc_status_kb("RssAnon")
        self._period_s = period_s
        threading.Thread(target=self._run, name="heap-sampler", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, proc_status_kb("RssAnon"))
            time.sleep(self._period_s)


if __name__ == "__main__":
    sys.exit(main())
