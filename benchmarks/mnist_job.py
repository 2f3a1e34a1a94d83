"""The classic MNIST job end to end against the same job on other stacks, interleaved in one run.

The job is the quickstart's: ``tensorfleet launch --ps 1 --workers 2
examples/mnist_mlp.py`` (784-100-10 MLP, Adam 0.01, batch 100, asynchronous,
10,000 global steps, one intra-op thread per process).  Its steps/sec is
10,000 / the workers' "Training elapsed time" (the slower of the two: the
training loop only).  Against, in the same rounds:

* the same job by in-graph replication (``launch --coordinator examples/mnist_coordinator.py``);
* one local process doing all 10,000 steps of the same model and batch (forward,
  backward, torch.optim Adam): the ceiling on a 2-core machine;
* a ``torch.distributed.rpc`` parameter server (``mnist_references.py rpc``);
* TensorFlow 2's ``ParameterServerStrategy`` (``mnist_references.py tf2``), run with
  the Python given by ``--tf-python`` (or ``$TF_PYTHON``), one that has TensorFlow;
  without it that row is left out, not quoted.

    python benchmarks/mnist_job.py [--repeats 3] [--tf-python ~/tf/bin/python] [--json mnist_job.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from mnist_mlp import build_model  # noqa: E402
from tensorfleet.data.mnist import batches, load_mnist  # noqa: E402

STEPS = 10_000


def run_job() -> dict[str, float]:
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "launch", "--ps", "1", "--workers", "2",
                           str(ROOT / "examples" / "mnist_mlp.py")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if done.returncode:
        raise RuntimeError(f"the job failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    elapsed = max(float(s) for s in re.findall(r"Training elapsed time: ([\d.]+) s", done.stdout))
    averaged = float(re.search(r"test accuracy: ([\d.]+) \(moving average", done.stdout).group(1))
    last = float(re.search(r"test accuracy of the last parameters: ([\d.]+)", done.stdout).group(1))
    return {"seconds": elapsed, "steps_per_sec": STEPS / elapsed, "accuracy_averaged": averaged,
            "accuracy_last": last}


def run_coordinated() -> dict[str, float]:
    """The same job by in-graph replication: ``launch --coordinator`` with ``examples/mnist_coordinator.py`` (the
    coordinator's own "Training elapsed time": scheduling to join, closures of 50 steps)."""
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "launch", "--coordinator", "--ps", "1",
                           "--workers", "2", str(ROOT / "examples" / "mnist_coordinator.py"), "--", "--train_steps",
                           str(STEPS)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"the coordinated job failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    elapsed = float(re.search(r"\[chief:0\] Training elapsed time: ([\d.]+) s", done.stdout).group(1))
    last = float(re.search(r"test accuracy of the last parameters: ([\d.]+)", done.stdout).group(1))
    # The steps it ran: a few closures past STEPS (those scheduled ahead when the StopAtStepHook stopped it).
    first, end = map(int, re.search(r"global step (\d+) -> (\d+)", done.stdout).groups())
    return {"seconds": elapsed, "steps_per_sec": (end - first) / elapsed, "accuracy_last": last}


def run_local() -> dict[str, float]:
    """One process, every step: the ceiling for 10,000 steps on this machine."""
    torch.set_num_threads(1)
    mnist = load_mnist()
    data = batches(mnist.train, 100, seed=0)
    torch.manual_seed(0)
    model = build_model(100)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    start = time.perf_counter()
    for _ in range(STEPS):
        images, labels = next(data)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(mnist.test.images).argmax(1) == mnist.test.labels).float().mean().item()
    return {"seconds": elapsed, "steps_per_sec": STEPS / elapsed, "accuracy_last": accuracy}


def run_reference(which: str, python: str) -> dict[str, float]:
    done = subprocess.run([python, str(ROOT / "benchmarks" / "mnist_references.py"), which, "--steps", str(STEPS)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"the {which} reference failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tf-python", default=os.environ.get("TF_PYTHON"),
                        help="a Python with TensorFlow, for the ParameterServerStrategy row")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runners = {"tensorfleet": run_job, "coordinator": run_coordinated, "local": run_local,
               "rpc": lambda: run_reference("rpc", sys.executable)}
    if args.tf_python:
        runners["tf2"] = lambda: run_reference("tf2", args.tf_python)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for round_ in range(args.repeats):  # interleaved: every stack sees the same state of the machine
        for name, run in runners.items():
            runs[name].append(run())
            print(f"round {round_ + 1}: {name} {runs[name][-1]['steps_per_sec']:.0f} steps/s", flush=True)
    medians = {name: median_of(results) for name, results in runs.items()}
    job = medians["tensorfleet"]
    labels = {"tensorfleet": "tensorfleet, 1 ps + 2 async workers",
              "coordinator": "tensorfleet by a coordinator (in-graph), 1+2", "local": "one local process (the ceiling)",
              "rpc": "torch.distributed.rpc ps, 1 ps + 2 workers", "tf2": "TF2 ParameterServerStrategy, 1+2"}
    print(f"MNIST MLP, {STEPS:,} global steps, median of {args.repeats} interleaved rounds (training loop only)")
    print(f"{'run':<44}{'seconds':>9}{'steps/s':>10}{'tensorfleet is':>16}{'accuracy (last)':>17}")
    for name, median in medians.items():
        ratio = job["steps_per_sec"] / median["steps_per_sec"]
        print(f"{labels[name]:<44}{median['seconds']:>9.1f}{median['steps_per_sec']:>10.0f}{ratio:>15.2f}x"
              f"{median['accuracy_last']:>17.4f}")
    print(f"tensorfleet's accuracy of the moving average (decay 0.999): {job['accuracy_averaged']:.4f}")
    if "tf2" in medians:  # issue 33's target: the coordinator at least 2x TF2's coordinator
        print(f"coordinator / TF2 ParameterServerStrategy + ClusterCoordinator: "
              f"{medians['coordinator']['steps_per_sec'] / medians['tf2']['steps_per_sec']:.2f}x (target >= 2x)")
    if args.json:
        result = {"repeats": args.repeats, "steps": STEPS, "medians": medians, "runs": runs,
                  "ratios": {name: job["steps_per_sec"] / m["steps_per_sec"] for name, m in medians.items()}}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
