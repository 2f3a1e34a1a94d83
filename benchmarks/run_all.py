"""Every figure the README's Speed table quotes, from one run: each script in turn, JSON kept, one table out.

    python benchmarks/run_all.py [--tf-python ~/tf/bin/python] [--out bench-results]

Runs ``mnist_job.py`` (the quickstart job vs one local process, a torch.distributed.rpc
ps and, given a Python with TensorFlow, TF2's ParameterServerStrategy),
``wire_throughput.py``, ``step_overhead.py``, ``vs_ddp.py`` and ``overlap.py`` with the
arguments below, one after the other (never two at once: they share the cores), writes
each one's JSON to ``--out`` and prints the Speed table in Markdown with the machine and
the date.  Takes about 25 minutes on the 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RUNS: dict[str, list[str]] = {
    "mnist_job": ["--repeats", "3"],
    "wire_throughput": ["--repeats", "9"],
    "step_overhead": ["--steps", "300", "--repeats", "7"],
    "vs_ddp": ["--steps", "30", "--repeats", "3"],
    "overlap": ["--steps", "30", "--repeats", "5"],
}


def machine() -> str:
    """``2 cores (Intel ... ), 24 GiB, Linux 6.1, Python 3.11.7, torch 2.13.0``."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch
    return (f"{len(os.sched_getaffinity(0))} cores ({model}), {memory:.0f} GiB, {platform.system()} "
            f"{platform.release().split('-')[0]}, Python {platform.python_version()}, torch {torch.__version__}")


def run(name: str, extra: list[str], out: Path) -> dict[str, Any]:
    path = out / f"{name}.json"
    command = [sys.executable, str(HERE / f"{name}.py"), *RUNS[name], *extra, "--json", str(path)]
    print(f"+ {' '.join(command)}", flush=True)
    subprocess.run(command, check=True, timeout=3600)
    return json.loads(path.read_text())


def table(results: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """(what, figure) rows of the README's Speed table."""
    job, wire = results["mnist_job"], results["wire_throughput"]
    step, ddp, overlap = results["step_overhead"], results["vs_ddp"], results["overlap"]
    medians, ratios = job["medians"], job["ratios"]
    others = ", ".join(f"{ratios[name]:.2f}x {label} ({medians[name]['steps_per_sec']:.0f})"
                       for name, label in (("local", "one local process"), ("rpc", "a torch.distributed.rpc ps"),
                                           ("tf2", "TF2's ParameterServerStrategy")) if name in ratios)
    gains = overlap["gain_over_plain"]
    rows = [
        ("the quickstart job (1 ps + 2 async workers, 10,000 steps, training loop)",
         f"{medians['tensorfleet']['steps_per_sec']:.0f} steps/s: {others}; accuracy "
         f"{medians['tensorfleet']['accuracy_averaged']:.4f} averaged, {medians['tensorfleet']['accuracy_last']:.4f} last"),
        ("push + pull of 64 MiB through a real ps",
         f"through shared memory {wire['ps_push_pull_64MiB_shared_memory_GBps']:.2f} GB/s, "
         f"{wire['ratio_ps_shared_memory_to_raw_best']:.2f}x raw TCP at its best; over TCP "
         f"{wire['ps_push_pull_64MiB_GBps']:.2f} GB/s, {wire['goal1_ratio_ps_push_pull_to_raw_best']:.2f}x; "
         f"gRPC unary {wire['ratio_grpc_to_raw_64MiB']:.2f}x"),
        ("one async MNIST MLP step, 1 ps + 1 worker, vs a local step",
         f"{step['ratio_distributed_to_local']:.2f}x with polling (launch's choice on 2 cores), "
         f"{step['ratio_no_polling_to_local']:.2f}x without"),
        ("2 sync workers + 2 ps, 15.8 M parameters, vs torch DDP (gloo) samples/s",
         f"{ddp['goal3_ratio_to_ddp']:.2f}x (overlap off {ddp['ratio_overlap_off_to_ddp']:.2f}x, over TCP "
         f"{ddp['ratio_over_tcp_to_ddp']:.2f}x, bf16 on the wire {ddp['goal6_bf16_ratio_to_ddp']:.2f}x)"),
        ("1 async worker + 1 ps, 15.8 M parameters: overlap and prefetch vs neither",
         ", ".join(f"{name} {gain:.2f}x" for name, gain in gains.items() if name != "plain")),
    ]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--tf-python", default=os.environ.get("TF_PYTHON"),
                        help="a Python with TensorFlow, for mnist_job.py's ParameterServerStrategy row")
    parser.add_argument("--out", default="bench-results", help="folder for each script's JSON")
    parser.add_argument("--only", nargs="+", choices=sorted(RUNS), default=sorted(RUNS),
                        help="run just these; the others' figures come from the JSON an earlier run left in --out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {name: run(name, ["--tf-python", args.tf_python] if name == "mnist_job" and args.tf_python else [],
                         out) if name in args.only else json.loads((out / f"{name}.json").read_text())
               for name in RUNS}
    print(f"\nMeasured {datetime.date.today().isoformat()} on {machine()} "
          f"(`python benchmarks/run_all.py`, medians of each script's interleaved runs):\n")
    print("| what | figure |\n| --- | --- |")
    for what, figure in table(results):
        print(f"| {what} | {figure} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
