"""One distributed step (1 ps + 1 worker on loopback) against one local step of the same model and batch.

The reference is measured in the same run: a single process doing forward,
backward and a torch.optim Adam step on the MNIST MLP.  The distributed step is
pull + forward + backward + push against a ps in another process.  Both use one
intra-op thread.  Figures are medians over repeats; the ratio is what matters.

    python benchmarks/step_overhead.py [--steps 300] [--repeats 7] [--json out.json]
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import tensorfleet as tfl  # noqa: E402
from tensorfleet.cluster.spec import TaskSpec  # noqa: E402
from tensorfleet.launch.local import local_cluster  # noqa: E402
from mnist_mlp import build_model  # noqa: E402


def time_steps(step, steps: int, repeats: int) -> list[float]:
    """Seconds per step, one figure per repeat (after a warm-up repeat)."""
    step()
    figures = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        figures.append((time.perf_counter() - start) / steps)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch_size", type=int, default=100)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    images, labels = torch.rand(args.batch_size, 784), torch.randint(0, 10, (args.batch_size,))

    local_model = build_model(100)
    local_opt = torch.optim.Adam(local_model.parameters(), lr=0.01)

    def local_step() -> None:
        local_opt.zero_grad()
        nn.functional.cross_entropy(local_model(images), labels).backward()
        local_opt.step()

    cluster = local_cluster(1, 1)
    env = {**os.environ, "TF_CONFIG": cluster.to_tf_config(TaskSpec("ps", 0)), "OMP_NUM_THREADS": "1"}
    ps = subprocess.Popen([sys.executable, "-m", "tensorfleet.ps"], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        model = build_model(100)
        replica = tfl.Replica(model, cluster, TaskSpec("worker", 0), optimizer=tfl.OptimizerSpec.adam(lr=0.01))
        replica.start()

        def distributed_step() -> None:
            replica.pull()
            nn.functional.cross_entropy(model(images), labels).backward()
            replica.push()

        # Interleave the two so drift in machine load hits both alike.
        local, remote = [], []
        for _ in range(args.repeats):
            local += time_steps(local_step, args.steps, 1)
            remote += time_steps(distributed_step, args.steps, 1)
        pull = time_steps(replica.pull, args.steps, args.repeats)
        replica.finish()
        ps.wait(timeout=30)
    finally:
        if ps.poll() is None:
            ps.kill()
            ps.wait()

    result = {
        "model": "MNIST MLP 784-100-10", "batch_size": args.batch_size, "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "local_step_ms": statistics.median(local) * 1e3,
        "distributed_step_ms": statistics.median(remote) * 1e3,
        "pull_only_ms": statistics.median(pull) * 1e3,
    }
    result["ratio_distributed_to_local"] = result["distributed_step_ms"] / result["local_step_ms"]
    print(f"{'what':<34}{'median':>12}")
    print(f"{'local step (fwd+bwd+Adam)':<34}{result['local_step_ms']:>9.3f} ms")
    print(f"{'distributed step (pull+fwd+bwd+push)':<34}{result['distributed_step_ms']:>9.3f} ms")
    print(f"{'  of which one pull':<34}{result['pull_only_ms']:>9.3f} ms")
    print(f"{'ratio distributed / local':<34}{result['ratio_distributed_to_local']:>10.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
