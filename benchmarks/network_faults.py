"""Faults of the network: partitions, lossy and slow links, and a 1 Gbit/s link against DDP.

Every task runs on a host of its own (``tensorfleet.testing.network``: one network
namespace per task, joined by a user-space switch that delays, drops, rate-limits and
cuts packets; the kernel's netem is not needed). Three parts, each a command:

* ``partitions``: the MNIST job (``examples/mnist_mlp.py``, async and sync) while one
  host is cut off for 10 s and for 120 s (twice the 60 s RPC deadline): the ps, the
  chief, a worker. Reported: exit codes, time from the heal until the global step moves,
  recoveries, pushes applied against accepted (nothing applied twice), test accuracy.
* ``lossy``: the same job on a perfect network and with 1 % loss and 2 ms ± 1 ms delay on
  every link (each direction): elapsed training time and the slowdown.
* ``bandwidth``: every link limited to ``--rate_gbit`` (1 Gbit/s) each way: the dense
  sync job of ``benchmarks/vs_ddp.py`` (15.8 M parameters, 2 workers, 2 ps) against torch
  DDP (gloo) on the same hosts, fp32, and 16 bits on the wire on both sides (DDP's
  ``fp16_compress_hook``: its bf16 hook needs CUDA; ours bf16); samples/s and MB per step on the
  busiest link.

    python benchmarks/network_faults.py partitions|lossy|bandwidth|all [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "mnist_mlp.py"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tensorfleet.cluster.spec import ClusterSpec  # noqa: E402
from tensorfleet.testing.fleet import Fleet, poll  # noqa: E402
from tensorfleet.testing.network import DEVICE, Network  # noqa: E402
from vs_ddp import ps_processes  # noqa: E402

MNIST_TASKS = ["ps:0", "worker:0", "worker:1"]


def _mnist_args(mode: str, steps: int, logdir: Path) -> list[str]:
    return ["--train_steps", str(steps), "--log_every", "100000", "--checkpoint_dir", str(logdir / "ckpt"),
            "--save_checkpoint_steps", "1000", *(["--sync"] if mode == "sync" else [])]


def _outcome(fleet: Fleet, codes: dict[str, int | None]) -> dict[str, Any]:
    """What the job's logs say: accuracies, recoveries, and the ps's counters when it exited."""
    workers = [fleet.log(name) for name in ("worker:0", "worker:1")]
    accuracy = [float(a) for log in workers for a in re.findall(r"^test accuracy: ([\d.]+)", log, re.M)]
    recoveries = sum(int(r) for log in workers for r in re.findall(r", (\d+) recoveries", log))
    elapsed = [float(e) for log in workers for e in re.findall(r"Training elapsed time: ([\d.]+) s", log)]
    exit_line = re.search(r"done; exiting \((.*)\)", fleet.log("ps:0"))
    counters = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", exit_line.group(1))} if exit_line else {}
    return {"exit_codes": codes, "test_accuracy": accuracy, "recoveries": recoveries,
            "elapsed_s": max(elapsed) if elapsed else None, "ps_at_exit": counters}


class StatusWatch:
    """ps:0's Status every 0.2 s from the observer (unreachable while ps:0 is cut): the last one, and when
    the step first passed a mark."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet, self.last, self.samples = fleet, {}, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            asked = time.monotonic()  # a sample counts from when it was asked (an answer may come late)
            try:
                self.last = self.fleet.ps_status(timeout_s=0.5)
                self.samples.append((asked, self.last["global_step"]))
            except Exception:  # noqa: BLE001 - cut off, or gone at the end: the next sample tells
                pass

    def moved_after(self, since: float, timeout_s: float) -> float | None:
        """Seconds from ``since`` until the global step moved past the first one seen from then on (the
        step at the heal: samples before it may be older than the cut); None if it did not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            after = [(when, seen) for when, seen in list(self.samples) if when >= since]
            moved = [when for when, seen in after if seen > after[0][1]] if after else []
            if moved:
                return moved[0] - since
            time.sleep(0.1)  # the watch thread samples; wait for its next one
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_partition(mode: str, victim: str, cut_s: float, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tensorfleet-partition-") as tmp, \
            Network(MNIST_TASKS, seed=1) as network:
        fleet = Fleet(Path(tmp), JOB, _mnist_args(mode, steps, Path(tmp)), network=network)
        watch = StatusWatch(fleet)
        try:
            poll(lambda: watch.last.get("global_step", 0) >= steps // 5, 300, "a fifth of the steps")
            network.cut(victim)
            time.sleep(cut_s)  # the partition
            network.heal(victim)
            resumed_s = watch.moved_after(time.monotonic(), 300)
            codes = fleet.wait_all(900)
            last = watch.last
        finally:
            watch.stop()
            fleet.stop()
        return {"mode": mode, "victim": victim, "cut_s": cut_s, "resumed_after_heal_s": resumed_s,
                "accepted_pushes": last.get("accepted_pushes"), "retried_pushes": last.get("retried_pushes"),
                **_outcome(fleet, codes)}


def partitions(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    plan = [("async", "ps:0", 10.0), ("sync", "ps:0", 10.0), ("async", "ps:0", args.long_cut_s),
            ("sync", "ps:0", args.long_cut_s), ("async", "worker:0", args.long_cut_s),
            ("sync", "worker:1", args.long_cut_s)]
    print(f"{'mode':<6}{'cut':<10}{'for':>6}{'resumed':>9}{'recov':>6}{'applied':>9}{'accepted':>9}"
          f"{'retried':>8}  exit codes / accuracy")
    for mode, victim, cut_s in plan:
        run = run_partition(mode, victim, cut_s, args.steps)
        runs.append(run)
        ps = run["ps_at_exit"]
        resumed = f"{run['resumed_after_heal_s']:.1f} s" if run["resumed_after_heal_s"] is not None else "never"
        print(f"{mode:<6}{victim:<10}{cut_s:>5.0f}s{resumed:>9}{run['recoveries']:>6}"
              f"{ps.get('applied_updates', '?'):>9}{run['accepted_pushes'] or '?':>9}{run['retried_pushes'] or 0:>8}"
              f"  {list(run['exit_codes'].values())} {run['test_accuracy']}", flush=True)
    return runs


def run_mnist(mode: str, steps: int, shape: dict[str, float]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tensorfleet-lossy-") as tmp, Network(MNIST_TASKS, seed=1) as network:
        network.shape(**shape)
        fleet = Fleet(Path(tmp), JOB, _mnist_args(mode, steps, Path(tmp)), network=network)
        try:
            codes = fleet.wait_all(1200)
        finally:
            fleet.stop()
        return {**_outcome(fleet, codes), "switch": {k: v for k, v in network.stats().items() if "bytes" not in k}}


def lossy(args: argparse.Namespace) -> dict[str, Any]:
    shaped = {"delay_s": 0.002, "jitter_s": 0.001, "loss": 0.01}
    result: dict[str, Any] = {}
    print(f"{'mode':<6}{'network':<28}{'elapsed':>9}{'slowdown':>10}  accuracy")
    for mode in ("async", "sync"):
        perfect = run_mnist(mode, args.steps, {})
        bad = run_mnist(mode, args.steps, shaped)
        slowdown = bad["elapsed_s"] / perfect["elapsed_s"] if bad["elapsed_s"] and perfect["elapsed_s"] else None
        result[mode] = {"perfect": perfect, "lossy": bad, "slowdown": slowdown}
        print(f"{mode:<6}{'perfect':<28}{perfect['elapsed_s']:>8.1f}s{'':>10}  {perfect['test_accuracy']}")
        print(f"{mode:<6}{'1% loss, 2±1 ms each way':<28}{bad['elapsed_s'] or float('nan'):>8.1f}s"
              f"{slowdown or float('nan'):>9.2f}x  {bad['test_accuracy']}  {bad['switch']}", flush=True)
    return result


# --- bandwidth: the dense sync job against DDP on rate-limited links ---------------------------------------
BANDWIDTH_HOSTS = ["worker:0", "worker:1", "ps:0", "ps:1"]


def ddp_role(rank: int, master: str, steps: int, fp16: bool) -> float:
    from vs_ddp import ddp_worker
    return ddp_worker(rank, 29500, steps, master=master, fp16=fp16)


def tensorfleet_role(cluster: ClusterSpec, index: int, steps: int, bf16: bool, dense: str = "ps") -> float:
    from vs_ddp import tensorfleet_worker
    return tensorfleet_worker(cluster, index, steps, overlap=dense == "ps", bf16=bf16, dense=dense)


@contextmanager
def _bandwidth_network(rate_gbit: float) -> Iterator[Network]:
    with Network(BANDWIDTH_HOSTS, mtu=65000, seed=1) as network:  # big frames: the switch's cost stays small
        network.shape(rate_bps=rate_gbit * 1e9)
        yield network


def _run_roles(network: Network, roles: dict[str, list[str]], env: dict[str, str]) -> list[float]:
    procs = [subprocess.Popen(network.command(host, [sys.executable, __file__, *argv]), stdout=subprocess.PIPE,
                              text=True, env=env) for host, argv in roles.items()]
    return [float(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]


def run_bandwidth_config(kind: str, bf16: bool, steps: int, rate_gbit: float) -> dict[str, Any]:
    """``kind``: "ddp", "tensorfleet" (every variable on 2 ps) or "hybrid" (dense by all-reduce, 1 ps)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": DEVICE}
    with _bandwidth_network(rate_gbit) as network:
        flags = ["--steps", str(steps), *(["--bf16"] if bf16 else [])]
        if kind == "ddp":
            master = network.address("worker:0")
            seconds = _run_roles(network, {f"worker:{r}": ["--role", "ddp", "--rank", str(r), "--master", master,
                                                          *flags] for r in range(2)}, env)
        else:
            num_ps = 1 if kind == "hybrid" else 2
            cluster = ClusterSpec.from_dict({job: [f"{network.address(f'{job}:{i}')}:2222" for i in range(count)]
                                             for job, count in (("ps", num_ps), ("worker", 2))})
            with ps_processes(cluster, env, on_host=network.command, wait_s=60):
                spec = json.dumps(cluster.as_dict())
                seconds = _run_roles(network, {f"worker:{i}": ["--role", "tensorfleet", "--cluster", spec, "--index",
                                                              str(i), "--dense", "allreduce" if kind == "hybrid"
                                                              else "ps", *flags] for i in range(2)}, env)
        stats = network.stats()
    from vs_ddp import BATCH, WARMUP
    busiest = max(max(stats["bytes_sent"][h], stats["bytes_received"][h]) for h in BANDWIDTH_HOSTS)
    return {"samples_per_sec": 2 * BATCH * steps / max(seconds), "busiest_link_mb_per_step": busiest / 1e6 / (
        steps + WARMUP), "lost_or_overflow": stats["overflow"] + stats["lost"]}


def bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    configs = {"DDP (gloo), fp32": ("ddp", False), "DDP, fp16_compress_hook": ("ddp", True),
               "tensorfleet sync, fp32": ("tensorfleet", False), "tensorfleet sync, bf16 wire": ("tensorfleet", True),
               "tensorfleet hybrid, fp32": ("hybrid", False)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for _ in range(args.repeats):  # interleaved
        for name, (kind, bf16) in configs.items():
            runs[name].append(run_bandwidth_config(kind, bf16, args.bandwidth_steps, args.rate_gbit))
    rates = {name: statistics.median(r["samples_per_sec"] for r in rs) for name, rs in runs.items()}
    ddp = rates["DDP (gloo), fp32"]
    print(f"every link {args.rate_gbit:g} Gbit/s each way; 15.8 M parameters, 2 workers x batch 64, "
          f"{args.bandwidth_steps} timed steps, median of {args.repeats}")
    print(f"{'configuration':<30}{'samples/s':>11}{'vs DDP':>9}{'busiest link MB/step':>22}")
    for name, rate in rates.items():
        mb = statistics.median(r["busiest_link_mb_per_step"] for r in runs[name])
        print(f"{name:<30}{rate:>11.1f}{rate / ddp:>8.2f}x{mb:>22.1f}")
    print("(MB/step: the busiest host's bytes in its busier direction over the whole run, start-up and "
          "warm-up steps included, per step)")
    return {"rate_gbit": args.rate_gbit, "runs": runs, "samples_per_sec": rates,
            "ratio_to_ddp_fp32": {name: rate / ddp for name, rate in rates.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("part", nargs="?", choices=["partitions", "lossy", "bandwidth", "all"], default="all")
    parser.add_argument("--steps", type=int, default=10000, help="the MNIST job's global steps")
    parser.add_argument("--long_cut_s", type=float, default=120.0, help="the long partition (2x the 60 s deadline)")
    parser.add_argument("--rate_gbit", type=float, default=1.0)
    parser.add_argument("--bandwidth_steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--role", choices=["ddp", "tensorfleet"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dense", choices=["ps", "allreduce"], default="ps", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        import torch
        torch.set_num_threads(1)
        if args.role == "ddp":
            print(ddp_role(args.rank, args.master, args.steps, args.bf16))
        else:
            cluster = ClusterSpec.from_dict(json.loads(args.cluster))
            print(tensorfleet_role(cluster, args.index, args.steps, args.bf16, args.dense))
        return 0
    reason = Network.unavailable()
    if reason:
        print(f"cannot run: {reason}")
        return 2
    os.environ.setdefault("TENSORFLEET_TOKEN", "faults-" + os.urandom(16).hex())  # a ps off loopback needs one
    result: dict[str, Any] = {}
    if args.part in ("lossy", "all"):
        result["lossy"] = lossy(args)
    if args.part in ("bandwidth", "all"):
        result["bandwidth"] = bandwidth(args)
    if args.part in ("partitions", "all"):
        result["partitions"] = partitions(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
