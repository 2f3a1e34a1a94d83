"""How long a job on Ray trains without a task whose node died: from the node's death to training again (issue 31).

    python benchmarks/ray_node_death.py [--rounds 2] [--task worker:1 --task ps:0]

A 3-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head without CPUs, 3 nodes of 2 CPUs);
the seed job (1 ps + 2 async workers, a checkpoint every 200 steps) under ``tensorfleet launch --backend ray``;
once it trains, the node of the chosen task is removed (its raylet and every process on it killed). Printed per
round: seconds from the kill to the task's process started again (Ray declaring the node dead and placing its
bundle elsewhere), to it answering, and to training again (the launcher's progress line moving after that: for
a ps, after the chief restored it from the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every address of this machine's cluster on 127.0.0.1

REPO = Path(__file__).resolve().parent.parent
STEP = re.compile(r"\[launch\] step ([\d,]+)/")


def one_round(cluster, nodes: dict, task: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ray-node-death-") as folder:
        logdir = Path(folder) / "job"
        command = [sys.executable, "-m", "tensorfleet.cli", "launch", "--backend", "ray", "--ray-address",
                   cluster.address, "--ps", "1", "--workers", "2", "--async", "--max-restarts", "3",
                   "--progress-every", "1", "--logdir", str(logdir), "examples/mnist_mlp.py", "--",
                   "--train_steps", "1000000", "--checkpoint_dir", f"{folder}/ckpt", "--save_checkpoint_steps", "200"]
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[tuple[float, str]] = []
        reader = threading.Thread(target=lambda: [lines.append((time.perf_counter(), line)) for line in process.stdout],
                                  daemon=True)
        reader.start()
        try:
            events = lambda: [json.loads(line) for line in (logdir / "events.jsonl").read_text().splitlines()] \
                if (logdir / "events.jsonl").exists() else []  # noqa: E731
            wait_for(lambda: any(not p.name.startswith("model.ckpt-0.") for p in Path(folder, "ckpt").glob("model*")),
                     180, "a checkpoint")
            first = next(e for e in events() if e["task"] == task and e["event"] == "started")
            doomed = next(name for name, node in nodes.items() if node.node_id == first["node"])
            killed = time.perf_counter()
            cluster.remove_node(nodes[doomed], allow_graceful=False)
            count = lambda kind: len([e for e in events() if e["task"] == task and e["event"] == kind])  # noqa: E731
            wait_for(lambda: count("started") == 2, 180, f"{task} to start again")
            started = time.perf_counter()
            wait_for(lambda: count("running") == 2, 180, f"{task} to answer")
            answered = time.perf_counter()

            def moving() -> float | None:
                steps = [(t, int(m.group(1).replace(",", ""))) for t, line in list(lines) if t > answered
                         for m in [STEP.search(line)] if m]
                return next((t for (t, s), (_, before) in zip(steps[1:], steps) if s != before), None)
            training = wait_for(moving, 180, "training again")
        finally:
            process.kill()
            process.wait()
        nodes[doomed] = cluster.add_node(num_cpus=2, resources={doomed: 1})
        cluster.wait_for_nodes()
        return {"started": started - killed, "answered": answered - killed, "training": training - killed}


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit(f"gave up waiting for {what} after {timeout_s:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--task", action="append", default=None, help="whose node dies (default: worker:1, ps:0)")
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "resources": {"node0": 1}})
    try:
        nodes = {f"node{i}": cluster.add_node(num_cpus=2, resources={f"node{i}": 1}) for i in (1, 2, 3)}
        cluster.wait_for_nodes()
        print("task      round  started again  answering  training again   (seconds after its node died)")
        for task in args.task or ["worker:1", "ps:0"]:
            for round_ in range(args.rounds):
                took = one_round(cluster, nodes, task)
                print(f"{task:<9} {round_ + 1:>5}  {took['started']:>13.1f}  {took['answered']:>9.1f}  "
                      f"{took['training']:>14.1f}", flush=True)
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
