"""Soak: the MNIST job for a long time (30 minutes by default) under periodic kills and partitions.

Every task runs on a host of its own (``tensorfleet.testing.network``). Every
``--every_s`` seconds (seeded random) one fault: a worker SIGKILLed and started again
(the chief or the other), or a host (the ps, the chief, a worker) cut off the network for
5 to 20 s. The ps is never killed: it lives the whole run, so its memory, threads and
open files can be compared from start to end (``benchmarks/chaos.py`` kills the ps).
Sampled every ``--sample_s``: the ps's RSS, threads and file descriptors.

At the end the workers are restarted with a target a little past the current global
step, so the job finishes by itself (the ps exits once every worker said Done); then
the run checks that no process of the job is left and nothing was left in /dev/shm.

    python benchmarks/soak.py [--minutes 30] [--every_s 60] [--seed 1] [--json soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "mnist_mlp.py"

from tensorfleet.testing.fleet import Fleet, poll  # noqa: E402
from tensorfleet.testing.network import Network  # noqa: E402

TASKS = ["ps:0", "worker:0", "worker:1"]
WARMUP_S = 120.0  # samples before this are not the baseline: the ps's memory grows while the job warms up
FINISH_STEPS = 2000  # the last leg: this many steps past the global step when the soak ends


def sample(process: psutil.Process) -> dict[str, float]:
    with process.oneshot():
        return {"t": time.monotonic(), "rss_mb": process.memory_info().rss / 1e6, "threads": process.num_threads(),
                "fds": process.num_fds()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--every_s", type=float, default=60.0, help="seconds between faults")
    parser.add_argument("--sample_s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    reason = Network.unavailable()
    if reason:
        print(f"cannot run: {reason}")
        return 2
    os.environ.setdefault("TENSORFLEET_TOKEN", "soak-" + os.urandom(16).hex())
    rng = random.Random(args.seed)
    logdir = Path(tempfile.mkdtemp(prefix="tensorfleet-soak-"))
    shm_before = set(os.listdir("/dev/shm"))

    def job_args(train_steps: int) -> list[str]:
        return ["--checkpoint_dir", str(logdir / "ckpt"), "--save_checkpoint_steps", "2000", "--log_every", "20000",
                "--train_steps", str(train_steps)]

    faults: list[dict] = []
    samples: list[dict] = []
    with Network(TASKS, seed=args.seed) as network:
        fleet = Fleet(logdir, JOB, job_args(10 ** 9), network=network)  # until the last leg
        try:
            ps = psutil.Process(fleet.procs["ps:0"].pid)
            poll(lambda: fleet.ps_status().global_step > 0, 120, "training to start")
            start = time.monotonic()
            end = start + args.minutes * 60
            stop_sampling = threading.Event()

            def sampler() -> None:
                while not stop_sampling.wait(args.sample_s):
                    samples.append({**sample(ps), "t": time.monotonic() - start})

            thread = threading.Thread(target=sampler, daemon=True)
            thread.start()
            next_fault = start + args.every_s
            while time.monotonic() < end:
                time.sleep(max(min(next_fault, end) - time.monotonic(), 0))  # the soak's own pace
                if time.monotonic() >= end:
                    break
                next_fault += args.every_s
                step = fleet.ps_status().global_step
                if rng.random() < 0.5:
                    victim = rng.choice(["worker:0", "worker:1"])
                    fleet.kill(victim)
                    fleet.start(victim)
                    faults.append({"t": time.monotonic() - start, "kind": "kill", "task": victim, "step": step})
                else:
                    victim = rng.choice(TASKS)
                    seconds = rng.uniform(5, 20)
                    network.cut(victim)
                    time.sleep(seconds)  # the partition
                    network.heal(victim)
                    faults.append({"t": time.monotonic() - start, "kind": "cut", "task": victim,
                                   "seconds": round(seconds, 1), "step": step})
                print(f"{faults[-1]['t']:7.0f} s  global step {step:>8}  {faults[-1]['kind']} {victim}", flush=True)
            stop_sampling.set()
            thread.join()
            # The last leg: both workers again, with a target the job reaches in a few seconds.
            step = fleet.ps_status().global_step
            last = step + FINISH_STEPS
            for name in ("worker:0", "worker:1"):
                fleet.kill(name)
            fleet.script_args = job_args(last)
            for name in ("worker:0", "worker:1"):
                fleet.start(name)
            codes = fleet.wait_all(600)
        finally:
            fleet.stop()
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"])
                 if str(logdir) in " ".join(p.info["cmdline"] or [])]
    shm_left = sorted(set(os.listdir("/dev/shm")) - shm_before)
    accuracies = [float(a) for a in re.findall(r"^test accuracy: ([\d.]+)", fleet.log("worker:0") + fleet.log("worker:1"),
                                                re.M)]
    baseline = [s for s in samples if s["t"] >= WARMUP_S][:3] or samples[:3]
    final = samples[-3:]

    def growth(key: str) -> float:
        return statistics.median(s[key] for s in final) - statistics.median(s[key] for s in baseline)

    result = {"minutes": args.minutes, "faults": faults, "exit_codes": codes, "final_target_step": last,
              "test_accuracy": accuracies, "ps_samples": samples,
              "ps_growth": {key: growth(key) for key in ("rss_mb", "threads", "fds")},
              "ps_range": {key: [min(s[key] for s in samples), max(s[key] for s in samples)]
                           for key in ("rss_mb", "threads", "fds")},
              "leftover_processes": leftovers, "leftover_shm_files": shm_left}
    kills = sum(f["kind"] == "kill" for f in faults)
    print(f"\n{args.minutes:g} min, {len(faults)} faults ({kills} kills, {len(faults) - kills} partitions); "
          f"exit codes {codes}; test accuracy {accuracies}")
    for key, unit in (("rss_mb", " MB"), ("threads", ""), ("fds", "")):
        low, high = result["ps_range"][key]
        print(f"ps {key:<7} baseline {statistics.median(s[key] for s in baseline):8.1f}{unit}  "
              f"end {statistics.median(s[key] for s in final):8.1f}{unit}  growth {growth(key):+7.1f}{unit}  "
              f"(range {low:.1f}..{high:.1f})")
    print(f"leftover processes: {leftovers or 'none'}; leftover /dev/shm files: {shm_left or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    ok = (all(code == 0 for code in codes.values()) and not leftovers and not shm_left
          and result["ps_growth"]["threads"] <= 2 and result["ps_growth"]["fds"] <= 2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
