"""The worker's host work for one table per step: today's path against the compiled pass, in the same run.

Before (issue 39): ``torch.unique(flat, return_inverse=True)``, ``Route.of`` of the unique ids (``shard_of``'s
numpy hashing, a bincount, a stable argsort by shard, the inverse permutation) and the inverse map put through
``position.index_select``. After: ``worker/routing.py``'s ``unique_by_shard``, one compiled pass (numba,
``nogil``) that gives the same three things (each shard's ids in first-seen order instead of ascending).

A batch is ``--batch`` samples of ``--per-sample`` ids (4096 x 8 = 32k ids, the click-through job's), drawn
from a ``--space`` id space either Zipf-like (``--zipf``; repeats, as real ids) or uniform; ``--shards`` ps.
Each round times every path on the same ``--pool`` batches, paths interleaved; the figure is the median over
``--repeats`` rounds of one step's time, in microseconds, and the ratio before / after; "best" is the fastest
round of each (what a quiet machine gives: other tenants only add time).

    python benchmarks/table_routing.py [--shards 1,2,4] [--repeats 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tensorfleet.worker.client import Route
from tensorfleet.worker.routing import COMPILED, unique_by_shard


def today(flat: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The path before the pass: unique ids in shard order and the inverse map onto them."""
    unique, inverse = torch.unique(flat, return_inverse=True)
    route = Route.of(unique, num_shards)
    return route.ids, inverse if route.position is None else route.position.index_select(0, inverse)


def compiled(flat: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    unique, _, inverse = unique_by_shard(flat, num_shards)
    return unique, inverse


PATHS: dict[str, Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]] = {
    "today": today, "compiled": compiled}


def batches(distribution: str, args: argparse.Namespace, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    size = args.batch * args.per_sample
    made = []
    for _ in range(args.pool):
        if distribution == "zipf":
            ids = (rng.zipf(args.zipf, size) - 1) % args.space
        else:
            ids = rng.integers(0, args.space, size)
        made.append(torch.from_numpy(ids.astype(np.int64)))
    return made


def round_us(path: Callable, pool: list[torch.Tensor], num_shards: int) -> float:
    """One round: every batch of the pool through ``path``; microseconds per batch."""
    began = time.perf_counter()
    for flat in pool:
        path(flat, num_shards)
    return (time.perf_counter() - began) / len(pool) * 1e6


def measure(distribution: str, num_shards: int, args: argparse.Namespace) -> dict:
    pool = batches(distribution, args, seed=num_shards)
    for name, path in PATHS.items():  # warm: compiled (or loaded from the cache), allocator settled
        round_us(path, pool[:2], num_shards)
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    for _ in range(args.repeats):
        for name, path in PATHS.items():
            times[name].append(round_us(path, pool, num_shards))
    unique = sum(int(torch.unique(flat).numel()) for flat in pool) / len(pool)
    medians = {name: statistics.median(values) for name, values in times.items()}
    best = {name: min(values) for name, values in times.items()}
    return {"distribution": distribution, "shards": num_shards, "ids": args.batch * args.per_sample,
            "unique": unique, "us": medians, "ratio": medians["today"] / medians["compiled"], "best_us": best,
            "best_ratio": best["today"] / best["compiled"], "rounds": times}


def listed(parse):
    return lambda text: [parse(item) for item in text.split(",") if item.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=listed(int), default=[1, 2, 4])
    parser.add_argument("--distributions", type=listed(str), default=["zipf", "uniform"])
    parser.add_argument("--batch", type=int, default=4096, help="samples a step")
    parser.add_argument("--per-sample", type=int, default=8, help="ids a sample")
    parser.add_argument("--space", type=int, default=10_000_000, help="ids 0..space-1")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--pool", type=int, default=8, help="batches a round")
    parser.add_argument("--repeats", type=int, default=30, help="rounds (the median is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not COMPILED:
        parser.error("numba cannot be imported: the compiled pass would be the reference path itself")
    torch.set_num_threads(args.threads)
    results = [measure(distribution, shards, args) for distribution in args.distributions for shards in args.shards]
    print(f"one table's host work a step: {args.batch} x {args.per_sample} ids from {args.space:,}, median of "
          f"{args.repeats} rounds of {args.pool} batches, {args.threads} torch thread(s)")
    print(f"{'ids':<8} {'shards':>6} {'unique':>8} {'today us':>9} {'compiled us':>12} {'ratio':>6}   "
          f"{'best: today':>11} {'compiled':>9} {'ratio':>6}")
    for r in results:
        print(f"{r['distribution']:<8} {r['shards']:>6} {r['unique']:>8,.0f} {r['us']['today']:>9,.0f} "
              f"{r['us']['compiled']:>12,.0f} {r['ratio']:>5.1f}x   {r['best_us']['today']:>11,.0f} "
              f"{r['best_us']['compiled']:>9,.0f} {r['best_ratio']:>5.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
