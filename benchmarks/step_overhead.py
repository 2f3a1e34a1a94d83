"""One distributed step (1 ps + 1 worker on loopback) against one local step of the same model and batch.

The reference is measured in the same run: a single process doing forward,
backward and a torch.optim Adam step on the MNIST MLP, with the default Adam
(what a local script runs) and with ``fused=True`` (the kernel the ps runs).
The distributed step is pull + forward + backward + push against a ps in
another process: with the data connections polling before they sleep, as
`tensorfleet launch` sets them up when every task has a core of its own (and
with overlap: gradients sent during backward), and without polling. One more ps requires the job's token, as
every task `tensorfleet launch` starts does: its step is the same distributed step with every connection's
server proof and every call's proof, so "with the token / without" is what authentication costs a step.
All use one intra-op thread.  Figures are medians over interleaved repeats;
the ratios are what matter.

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
from tensorfleet.cluster.machine import busy_poll_for  # noqa: E402
from tensorfleet.cluster.ports import local_cluster  # noqa: E402
from tensorfleet.wire import auth  # noqa: E402
from tensorfleet.wire.rpc import BUSY_POLL_ENV, WireOptions  # noqa: E402
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch_size", type=int, default=100)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    images, labels = torch.rand(args.batch_size, 784), torch.randint(0, 10, (args.batch_size,))

    def make_local_step(fused: bool):
        local_model = build_model(100)
        local_opt = torch.optim.Adam(local_model.parameters(), lr=0.01, fused=fused)

        def local_step() -> None:
            local_opt.zero_grad()
            nn.functional.cross_entropy(local_model(images), labels).backward()
            local_opt.step()
        return local_step

    # Two ps processes: one polls its data connections before sleeping as `tensorfleet launch` would set it up
    # for these 2 tasks (1 ps + 1 worker: polling when they have a core each), one never polls.
    poll_us = busy_poll_for(2)
    token = auth.new_token()
    setups = {"polling": (local_cluster(1, 2), poll_us, None), "no_polling": (local_cluster(1, 1), 0, None),
              "token": (local_cluster(1, 1), poll_us, token)}
    servers = []
    try:
        for cluster, busy_poll, job_token in setups.values():
            env = {**os.environ, "TF_CONFIG": cluster.to_tf_config(TaskSpec("ps", 0)), "OMP_NUM_THREADS": "1",
                   BUSY_POLL_ENV: str(busy_poll)}
            env.pop(auth.TOKEN_ENV, None)
            env.pop(auth.TOKEN_FILE_ENV, None)
            if job_token is not None:
                env[auth.TOKEN_ENV] = job_token
            servers.append(subprocess.Popen([sys.executable, "-m", "tensorfleet.ps"], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        steps = {"local": make_local_step(False), "local_fused": make_local_step(True)}
        replicas = {}
        # (name, setup, worker index, overlap): replicas of one ps use their own worker ids (exactly-once
        # bookkeeping refuses two live processes claiming one id)
        for name, setup, index, overlap in (("distributed", "polling", 0, False), ("overlap", "polling", 1, True),
                                            ("no_polling", "no_polling", 0, False), ("token", "token", 0, False)):
            cluster, busy_poll, job_token = setups[setup]
            model = build_model(100)
            replica = tfl.Replica(model, cluster, TaskSpec("worker", index), optimizer=tfl.OptimizerSpec.adam(lr=0.01),
                                  overlap=overlap, wire=WireOptions(busy_poll_us=busy_poll, token=job_token))
            replica.start()
            replicas[name] = replica

            def distributed_step(replica=replica, model=model) -> None:
                replica.pull()
                nn.functional.cross_entropy(model(images), labels).backward()
                replica.push()
            steps[name] = distributed_step

        # Interleave them all so drift in machine load hits each alike.
        figures: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.repeats):
            for name, step in steps.items():
                figures[name] += time_steps(step, args.steps, 1)
        first = replicas["distributed"]
        pull = time_steps(lambda: first.client.pull(into=first._param_views), args.steps, args.repeats)
        for replica in replicas.values():
            replica.finish()
        for server in servers:
            server.wait(timeout=30)
    finally:
        for server in servers:
            if server.poll() is None:
                server.kill()
                server.wait()

    ms = {name: statistics.median(values) * 1e3 for name, values in figures.items()}
    result = {
        "model": "MNIST MLP 784-100-10", "batch_size": args.batch_size, "steps_per_repeat": args.steps,
        "repeats": args.repeats, "local_step_ms": ms["local"], "local_fused_step_ms": ms["local_fused"],
        "busy_poll_us": poll_us,
        "distributed_step_ms": ms["distributed"], "distributed_overlap_step_ms": ms["overlap"],
        "distributed_no_polling_step_ms": ms["no_polling"], "distributed_token_step_ms": ms["token"],
        "pull_only_ms": statistics.median(pull) * 1e3,
        "ratio_distributed_to_local": ms["distributed"] / ms["local"],
        "ratio_distributed_to_local_fused": ms["distributed"] / ms["local_fused"],
        "ratio_no_polling_to_local": ms["no_polling"] / ms["local"],
        "ratio_overlap_to_local": ms["overlap"] / ms["local"],
        "ratio_token_to_no_token": ms["token"] / ms["distributed"],
    }
    rows = [("local step (fwd+bwd+Adam)", ms["local"]), ("local step, fused Adam", ms["local_fused"]),
            (f"distributed step (polling {poll_us} us)", ms["distributed"]),
            ("distributed step, overlap on", ms["overlap"]),
            ("distributed step, no polling", ms["no_polling"]),
            ("distributed step, with the job's token", ms["token"]), ("  one pull on its own", result["pull_only_ms"])]
    print(f"{'what':<40}{'median':>12}")
    for label, value in rows:
        print(f"{label:<40}{value:>9.3f} ms")
    print(f"{'GOAL 2: distributed / local':<40}{result['ratio_distributed_to_local']:>10.2f}x  (target <= 1.5x)")
    print(f"{'distributed / local with fused Adam':<40}{result['ratio_distributed_to_local_fused']:>10.2f}x")
    print(f"{'no polling / local':<40}{result['ratio_no_polling_to_local']:>10.2f}x")
    print(f"{'overlap on / local':<40}{result['ratio_overlap_to_local']:>10.2f}x")
    print(f"{'with the token / without':<40}{result['ratio_token_to_no_token']:>10.2f}x  (proofs: ~1.00x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
