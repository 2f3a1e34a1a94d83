"""Bytes per row of an embedding table on one ps shard: the rows and optimizer slots alone ("bare") against
everything the shard holds for them ("held": storage with room to grow, and the id map), and the process's
peak RSS growth per row (higher than held: growing the storage copies it, so the old and the new storage
are both alive for a moment), for dim 16 and 64 and each per-row rule.

    python benchmarks/table_memory.py                # 1M rows
    python benchmarks/table_memory.py --rows 4000000

Target (issue 17): held <= 1.5x bare. Ids arrive in batches of 4096 random int64, as training creates them.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

import numpy as np
import torch

TARGET = 1.5


def measure(rows: int, dim: int, rule: str, batch: int = 4096) -> dict[str, float]:
    """One table filled to ``rows`` rows in this (fresh) process."""
    from tensorfleet.protocol.specs import OptimizerSpec, TableSpec
    from tensorfleet.ps.table import EmbeddingShard

    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(-2 ** 63, 2 ** 63 - 1, int(rows * 1.01), dtype=np.int64))[:rows]
    rng.shuffle(ids)
    grads = torch.zeros(batch, dim)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the test's own ids are not the table's
    shard = EmbeddingShard(TableSpec("t", dim, OptimizerSpec(rule, {"lr": 0.1})))
    for start in range(0, rows, batch):
        chunk = torch.from_numpy(ids[start:start + batch])
        shard.apply(chunk, grads[:len(chunk)], 0.1)
    del ids
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    per_row = shard.bytes_per_row()
    return {**per_row, "rows": len(shard), "rss_per_row": (peak - before) / len(shard)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--one", nargs=2, metavar=("DIM", "RULE"), help=argparse.SUPPRESS)  # a child's measurement
    args = parser.parse_args(argv)
    if args.one:
        result = measure(args.rows, int(args.one[0]), args.one[1])
        print(" ".join(f"{k}={v}" for k, v in result.items()))
        return 0
    print(f"{args.rows:,} rows per table; bytes per row (held/bare: target <= {TARGET})")
    print(f"{'dim':>4} {'rule':>8} {'bare':>7} {'map':>6} {'held':>7} {'held/bare':>9} {'peak RSS/row':>12}")
    for dim in (16, 64):
        for rule in ("sgd", "adagrad", "adam"):
            out = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--one", str(dim), rule],
                                 capture_output=True, text=True, check=True).stdout.split()
            r = {k: float(v) for k, v in (item.split("=") for item in out)}
            ratio = r["held"] / r["bare"]
            print(f"{dim:>4} {rule:>8} {r['bare']:>7.0f} {r['map']:>6.1f} {r['held']:>7.1f} {ratio:>9.2f} "
                  f"{r['rss_per_row']:>12.1f}" + ("" if ratio <= TARGET else "  MISSED"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
