"""Bytes per step each ps shard carries for the MNIST CNN under each placement strategy.

Every step, each worker pushes one gradient and pulls one value of every part,
so a shard carries ``2 x workers x (bytes of its parts)`` per step.  The figures
come from the same placement function the workers use (no cluster needed); the
busiest shard bounds the step time when the link is the bottleneck.

    python benchmarks/placement_bytes.py [--ps 2] [--workers 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from mnist_cnn import ConvNet  # noqa: E402

from tensorfleet.cluster.placement import GreedyByBytes, RoundRobin, RowPartitioner, VariableInfo, place  # noqa: E402
from tensorfleet.wire.codec import dtype_name  # noqa: E402

CONFIGS = {
    "round_robin": (RoundRobin(), None),
    "greedy": (GreedyByBytes(), None),
    "round_robin + 2 parts": (RoundRobin(), RowPartitioner(2, min_bytes=1 << 20)),
    "greedy + 2 parts": (GreedyByBytes(), RowPartitioner(2, min_bytes=1 << 20)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    infos = [VariableInfo(n, tuple(p.shape), dtype_name(p.dtype)) for n, p in ConvNet().named_parameters()]
    total = sum(i.num_bytes for i in infos)
    print(f"MNIST CNN: {len(infos)} variables, {total / 1e6:.2f} MB; {args.ps} ps, {args.workers} workers")
    header = "".join(f"{f'ps {s} MB/step':>16}" for s in range(args.ps))
    print(f"{'strategy':<24}{header}{'busiest/ideal':>16}")
    results = {}
    for name, (strategy, partitioner) in CONFIGS.items():
        loads = place(infos, args.ps, strategy=strategy, partitioner=partitioner).bytes_per_shard(args.ps)
        per_step = [2 * args.workers * b for b in loads]
        imbalance = max(loads) / (total / args.ps)
        results[name] = {"bytes_per_step": per_step, "busiest_over_ideal": imbalance}
        print(f"{name:<24}" + "".join(f"{b / 1e6:>16.2f}" for b in per_step) + f"{imbalance:>15.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
