"""The seed MNIST job under ``tensorfleet launch --backend local`` and ``--backend ray``, alternating, in one run:
what the Ray backend costs in steps/s and in start-up (issue 31).

    python benchmarks/launch_backends.py [--pairs 5] [--train_steps 15000] [--ray-address ADDR]

Each run is ``tensorfleet launch --backend B --ps 1 --workers 2 examples/mnist_mlp.py -- --train_steps N``. Printed
per run: the chief's training time (its own "Training elapsed time", so start-up is not in it), the seconds from
the command's start to the chief answering its first Status (``running`` in events.jsonl, counted from the
launcher's start: Ray's start-up is in it), and the wall time; then the means and Ray / local for steps/s.
Without ``--ray-address`` each Ray run starts its own local Ray, as a laptop user's would.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_run(backend: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"launch-{backend}-") as logdir:
        command = [sys.executable, "-m", "tensorfleet.cli", "launch", "--backend", backend, "--ps", "1",
                   "--workers", "2", "--logdir", logdir]
        if backend == "ray" and args.ray_address:
            command += ["--ray-address", args.ray_address]
        command += ["examples/mnist_mlp.py", "--", "--train_steps", str(args.train_steps)]
        began = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - began
        if done.returncode != 0:
            raise SystemExit(f"{backend} run failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
        training = float(re.findall(r"\[worker:0\] Training elapsed time: ([\d.]+) s", done.stdout)[-1])
        events = [json.loads(line) for line in (Path(logdir) / "events.jsonl").read_text().splitlines()]
        running = next(e["t"] for e in events if e["task"] == "worker:0" and e["event"] == "running")
    # events count from the supervisor's start, which comes after Ray's start-up: add what came before it
    launcher_start = wall - float(re.findall(r"succeeded after ([\d.]+) s", done.stdout)[-1])
    return {"training_s": training, "steps_per_s": args.train_steps / training, "wall_s": wall,
            "chief_running_s": launcher_start + running}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--train_steps", type=int, default=15000)
    parser.add_argument("--ray-address", dest="ray_address", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"local": [], "ray": []}
    for pair in range(args.pairs):
        for backend in ("local", "ray"):
            run = one_run(backend, args)
            runs[backend].append(run)
            print(f"pair {pair + 1} {backend:<5}: training {run['training_s']:.2f} s ({run['steps_per_s']:,.0f} "
                  f"steps/s), chief running {run['chief_running_s']:.1f} s after the command, wall {run['wall_s']:.1f} s",
                  flush=True)
    mean = {b: {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]} for b, rs in runs.items()}
    for backend, m in mean.items():
        print(f"mean {backend:<5}: {m['steps_per_s']:,.0f} steps/s, chief running after {m['chief_running_s']:.1f} s, "
              f"wall {m['wall_s']:.1f} s")
    print(f"ray / local, steps/s: {mean['ray']['steps_per_s'] / mean['local']['steps_per_s']:.2f}x (target: the "
          f"engine costs under 5 %); start-up: +{mean['ray']['chief_running_s'] - mean['local']['chief_running_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
