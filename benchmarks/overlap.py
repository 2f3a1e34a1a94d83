"""Goal 4: what overlapping communication with compute gains, 1 async worker + 1 ps, in one run.

The model and batch of ``vs_ddp.py`` (a 15.8 M-parameter MLP, batch 64, SGD with
momentum, one intra-op thread per process).  One worker and one ps leave a core for
the transfers and the ps's work while the worker computes, which is where overlap
can show.  Four configurations, interleaved, the same timed steps after a warm-up:

* plain: pull (free: the last push brought the values), forward, backward, push;
* overlap: each gradient leaves for the ps as soon as backward produces it;
* prefetch: ``push()`` returns at once, the push and its reply travel during the
  next step's compute (which uses values one update older; async mode only);
* overlap and prefetch together.

Steps/sec of each, and the ratio to plain, median of ``--repeats`` runs.

    python benchmarks/overlap.py [--steps 30] [--repeats 3] [--json overlap.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

import tensorfleet as tfl
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.cluster.ports import local_cluster

sys.path.insert(0, str(Path(__file__).parent))
from vs_ddp import LR, MOMENTUM, build_model, ps_processes, timed_steps  # noqa: E402  (the same model, data)

CONFIGURATIONS = {"plain": (False, False), "overlap": (True, False), "prefetch": (False, True),
                  "overlap + prefetch": (True, True)}


def worker(cluster: ClusterSpec, steps: int, overlap: bool, prefetch: bool) -> float:
    model = build_model()
    replica = tfl.Replica(model, cluster, TaskSpec("worker", 0), optimizer=tfl.OptimizerSpec.sgd(
        lr=LR, momentum=MOMENTUM), overlap=overlap, prefetch=prefetch)
    with replica:
        return timed_steps(replica, model, 0, steps)


def run(steps: int, overlap: bool, prefetch: bool) -> float:
    """One ps process and one worker process; the worker's timed seconds."""
    cluster = local_cluster(1, 1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with ps_processes(cluster, env):
        args = ["--role", "worker", "--cluster", json.dumps(cluster.as_dict()), "--steps", str(steps)]
        args += (["--overlap"] if overlap else []) + (["--prefetch"] if prefetch else [])
        out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env,
                             timeout=600, check=True).stdout
        return float(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--role", choices=["worker"], help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefetch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.role == "worker":
        print(worker(ClusterSpec.from_dict(json.loads(args.cluster)), args.steps, args.overlap, args.prefetch))
        return 0

    runs: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    for _ in range(args.repeats):  # interleaved, so drifting load hits every configuration alike
        for name, (overlap, prefetch) in CONFIGURATIONS.items():
            runs[name].append(args.steps / run(args.steps, overlap, prefetch))
    rates = {name: statistics.median(values) for name, values in runs.items()}
    plain = rates["plain"]
    result = {"steps": args.steps, "repeats": args.repeats, "steps_per_sec": rates, "steps_per_sec_runs": runs,
              "gain_over_plain": {name: rate / plain for name, rate in rates.items()}}
    print(f"1 async worker + 1 ps, MLP of {sum(p.numel() for p in build_model().parameters()) / 1e6:.1f} M "
          f"parameters, {args.steps} timed steps, median of {args.repeats} runs")
    print(f"{'configuration':<22}{'steps/sec':>12}{'vs plain':>10}")
    for name, rate in rates.items():
        print(f"{name:<22}{rate:>12.2f}{rate / plain:>9.2f}x")
    best = max((name for name in rates if name != "plain"), key=rates.get)
    print(f"GOAL 4: overlap on / off: {rates['overlap'] / plain:.2f}x (gradients during backward), "
          f"{rates['prefetch'] / plain:.2f}x (prefetch), best {best}: {rates[best] / plain:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
