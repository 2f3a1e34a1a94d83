"""What a delta checkpoint costs against a full one, on a table of 10M rows (issue 20).

    python benchmarks/delta_checkpoints.py                 # 10M rows, dim 32, Adagrad, 2 ps
    python benchmarks/delta_checkpoints.py --rows 1000000 --steps 500

A table of ``--rows`` rows (per-row Adagrad, dim ``--dim``) is filled on ``--ps`` in-process ps servers,
a full checkpoint is saved, then ``--steps`` training steps of ``--batch`` ids drawn from a Zipf
distribution over the table (exponent 1.1, as the synthetic click-through job's items), then a delta
checkpoint; ``--repeats`` rounds of those steps and a delta. Printed: both saves' bytes and seconds to disk and their ratio (targets: a delta after
1,000 steps at most 10 % of a full save's bytes and time), and the chief's training time lost to
checkpoints at one delta per ``--steps`` steps, against one full save per ``--steps`` steps (target:
under 1 %): its pause in ``save`` (with ``--background``, until every shard has taken its state; a
thread reads the rows and writes the file) plus how much slower the ``AFTER_STEPS`` steps after the
save run than the same steps without a save in flight, just before and after (the background reading
and writing compete for the cores), both the mean over the rounds (the difference is near this
machine's noise: one round is not enough to tell it). The saves and the steps run in this process against real ps servers on 127.0.0.1:
in this process too (they are filled straight through their stores), or with ``--ps_processes`` each
in a process of its own (``python -m tensorfleet.ps``, filled by pushes), as a job runs them: then
only the chief's own share of a save (its pause, reading the rows, gathering, writing) competes with
its steps in one interpreter, not the ps's copying and sending too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.protocol.messages import grads_key, ids_key
from tensorfleet.cluster.ports import local_cluster
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.train.checkpoint import Checkpointer, load
from tensorfleet.worker.embedding import EmbeddingTable
from tensorfleet.worker.replica import Replica

FILL_BATCH = 200_000
AFTER_STEPS = 200  # steps timed after a delta save, against the same steps without one
BYTES_TARGET = TIME_TARGET = 0.10
LOST_TARGET = 0.01


def fill(servers, rows: int, dim: int) -> None:
    """``rows`` rows in the table, pushed straight into each shard's store (as training would create them)."""
    from tensorfleet.cluster.idhash import shard_of
    ids = np.arange(rows, dtype=np.int64)
    owner = shard_of(ids, len(servers))
    for index, server in enumerate(servers):
        mine = torch.from_numpy(ids[owner == index])
        for start in range(0, mine.numel(), FILL_BATCH):
            chunk = mine[start:start + FILL_BATCH]
            server.store.apply({ids_key("t"): chunk, grads_key("t"): torch.full((chunk.numel(), dim), 0.01)},
                               advance_step=False)


def fill_by_pushes(table: EmbeddingTable, replica: Replica, rows: int) -> None:
    """``rows`` rows in the table, created by training pushes (ps servers in processes of their own)."""
    for start in range(0, rows, FILL_BATCH):
        table(torch.arange(start, min(start + FILL_BATCH, rows))).sum().backward()
        replica.push()


@contextlib.contextmanager
def ps_processes(num_ps: int) -> Iterator[tuple[ClusterSpec, list[subprocess.Popen]]]:
    """``num_ps`` ps tasks (``python -m tensorfleet.ps``) on free ports of 127.0.0.1; killed on exit."""
    cluster = local_cluster(num_ps, 1)
    processes = []
    try:
        for index in range(num_ps):
            env = {**os.environ, "TF_CONFIG": cluster.to_tf_config(TaskSpec("ps", index))}
            processes.append(subprocess.Popen([sys.executable, "-m", "tensorfleet.ps"], env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield cluster, processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


def zipf_batches(rows: int, batch: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, rows + 1, dtype=np.float64)
    weights = ranks ** -1.1
    weights /= weights.sum()
    draws = rng.choice(rows, size=(steps, batch), p=weights)
    return [torch.from_numpy(np.unique(step)) for step in draws]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--background", action="store_true",
                        help="Checkpointer(background=True): the chief's pause is the snapshot; a thread writes")
    parser.add_argument("--ps_processes", action="store_true",
                        help="each ps in a process of its own (as a job runs them), not in this one")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of --steps steps then a delta; the steps lost are their mean")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    batches = zipf_batches(args.rows, args.batch, args.steps)
    servers_of = ps_processes if args.ps_processes else ps_servers
    with tempfile.TemporaryDirectory() as folder, servers_of(num_ps=args.ps) as (cluster, servers):
        table = EmbeddingTable("t", args.dim, optimizer=OptimizerSpec("adagrad", {"lr": 0.05}))
        model = torch.nn.ModuleDict({"t": table})
        saver = Checkpointer(Path(folder), full_every=1_000_000, max_to_keep=10, background=args.background)
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.05)) as replica:
            started = time.perf_counter()
            if args.ps_processes:
                fill_by_pushes(table, replica, args.rows)
            else:
                fill(servers, args.rows, args.dim)
            print(f"filled {args.rows:,} rows in {time.perf_counter() - started:.1f} s", flush=True)

            started = time.perf_counter()
            full = saver.save(replica)
            full_s = time.perf_counter() - started  # with --background: the chief's pause only
            saver.wait()
            full_write_s = time.perf_counter() - started
            full_bytes = full.stat().st_size
            os.sync()  # the full file's pages reach the disk now, not while the delta's steps are timed
            print(f"full save: {full_bytes / 1e6:,.1f} MB; the chief paused {full_s:.2f} s, on disk after "
                  f"{full_write_s:.2f} s", flush=True)

            after = batches[:AFTER_STEPS]

            def steps(chunk: list[torch.Tensor]) -> float:
                started = time.perf_counter()
                for ids in chunk:
                    table(ids).sum().backward()
                    replica.push()
                return time.perf_counter() - started

            rounds = []
            for round_ in range(args.repeats):
                train_s = steps(batches)
                quiet_before_s = steps(after)  # the same steps with no save in flight, before and after
                started = time.perf_counter()
                delta = saver.save(replica)
                delta_s = time.perf_counter() - started
                delta_write_s = None
                for ids in after:  # training goes on while the rows travel and the file is written
                    table(ids).sum().backward()
                    replica.push()
                    if delta_write_s is None and not saver.writing:
                        delta_write_s = time.perf_counter() - started
                busy_s = time.perf_counter() - started - delta_s
                saver.wait()
                delta_write_s = delta_write_s or time.perf_counter() - started
                quiet_after_s = steps(after)
                assert ".delta." in delta.name, delta
                rounds.append({"train_s": train_s, "delta_s": delta_s, "delta_write_s": delta_write_s,
                               "delta_bytes": delta.stat().st_size, "after_busy_s": busy_s,
                               "after_quiet_before_s": quiet_before_s, "after_quiet_after_s": quiet_after_s})
                print(f"round {round_ + 1}: {args.steps} steps in {train_s:.1f} s; delta save "
                      f"{rounds[-1]['delta_bytes'] / 1e6:,.1f} MB, the chief paused {delta_s:.2f} s, on disk after "
                      f"{delta_write_s:.2f} s; the {len(after)} steps after it took {busy_s:.2f} s, without a save in "
                      f"flight {quiet_before_s:.2f} s before and {quiet_after_s:.2f} s after", flush=True)
            changed = len(np.unique(np.concatenate([b.numpy() for b in batches])))
            print(f"{args.steps} steps of {args.batch} Zipf ids touch {changed:,} distinct rows", flush=True)

            started = time.perf_counter()
            restored = load(delta)
            load_s = time.perf_counter() - started
            assert restored.state.tables["t"].ids.numel() == args.rows

    first = rounds[0]  # the delta after the first --steps steps: against the full save
    result = {"rows": args.rows, "dim": args.dim, "ps": args.ps, "ps_processes": args.ps_processes,
              "steps": args.steps, "batch": args.batch, "background": args.background,
              "changed_rows": changed, "full_bytes": full_bytes, "delta_bytes": first["delta_bytes"],
              "full_s": full_s, "full_write_s": full_write_s, "delta_write_s": first["delta_write_s"],
              "chain_load_s": load_s, "after_steps": len(after), "rounds": rounds,
              **{key: float(np.mean([r[key] for r in rounds]))
                 for key in ("train_s", "delta_s", "after_busy_s", "after_quiet_before_s", "after_quiet_after_s")}}
    result["after_quiet_s"] = (result["after_quiet_before_s"] + result["after_quiet_after_s"]) / 2
    return report(result, args.json)


def report(result: dict, json_path: str | None) -> int:
    bytes_ratio = result["delta_bytes"] / result["full_bytes"]
    time_ratio = result["delta_write_s"] / result["full_write_s"]
    slower = result["after_busy_s"] - result["after_quiet_s"]  # the background work's cost to the steps
    lost_s = result["delta_s"] + max(slower, 0.0)  # steps faster than without a save: noise, counted as 0
    lost_delta = lost_s / (result["train_s"] + lost_s)
    lost_full = result["full_s"] / (result["train_s"] + result["full_s"])
    result.update(bytes_ratio=bytes_ratio, time_ratio=time_ratio, lost_with_deltas=lost_delta,
                  lost_with_full_saves=lost_full)
    verdict = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    print(f"delta / full bytes: {bytes_ratio:.3f} (target <= {BYTES_TARGET}: {verdict(bytes_ratio <= BYTES_TARGET)})")
    print(f"delta / full time to disk: {time_ratio:.3f} (target <= {TIME_TARGET}: "
          f"{verdict(time_ratio <= TIME_TARGET)})")
    print(f"chief's time lost to a save every {result['steps']} steps: {100 * lost_delta:.2f} % with deltas "
          f"(mean of {len(result['rounds'])} round(s): paused {result['delta_s']:.3f} s, the next steps slower by "
          f"{slower:+.3f} s), "
          f"{100 * lost_full:.2f} % with full saves (target < {100 * LOST_TARGET:.0f} %: "
          f"{verdict(lost_delta < LOST_TARGET)})")
    print(f"loading the chain (full + {len(result['rounds'])} delta(s)): {result['chain_load_s']:.2f} s")
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
