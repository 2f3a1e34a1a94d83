"""A small, paced training job for the launcher and dashboard tests: slow enough to kill a task mid-run.

A tiny linear model on random data; each worker sleeps ``--step_sleep_s`` per step so
the job lasts seconds without loading the CPU, and reports loss and examples like a
real script.  ``--fail`` makes the named task exit 1 at once (a script that crashes at start-up), or
after ``--fail_after_s`` seconds of training (a crash mid-run).  ``--stop_file`` ends training early once that file
exists: a test that has seen what it wanted of a running job lets it finish instead of waiting for ``--last_step``.
"""

import argparse
import os
import sys
import time

import torch
from torch import nn

import tensorfleet as tfl


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.sgd(lr=0.05),
                          **tfl.training_options(args))
    generator = torch.Generator().manual_seed(cluster.replica_id(task))
    fail_at = time.monotonic() + args.fail_after_s if args.fail == task.short and args.fail_after_s else None
    with replica:
        replica.report(target_step=args.last_step)
        print(f"{task.short} starts at global step {replica.global_step}", flush=True)
        while replica.pull() < args.last_step and not (args.stop_file and os.path.exists(args.stop_file)):
            x = torch.randn(16, 8, generator=generator)
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            loss.backward()
            replica.push()
            replica.report(loss=loss.item(), examples=len(x))
            time.sleep(args.step_sleep_s)
            if fail_at is not None and time.monotonic() >= fail_at:
                print(f"{task.short}: failing on purpose after {args.fail_after_s} s", flush=True)
                os._exit(1)
    print(f"{task.short} done at global step {replica.global_step}", flush=True)
    if replica.is_chief:
        tfl.report_metrics(accuracy=0.5 + replica.global_step / 1e6)  # a job's final metric, as examples report it


def main() -> int:
    parser = argparse.ArgumentParser()
    tfl.add_cluster_flags(parser)
    tfl.add_training_flags(parser)
    parser.add_argument("--last_step", type=int, default=400)
    parser.add_argument("--step_sleep_s", type=float, default=0.01)
    parser.add_argument("--fail", default=None, help="a task (worker:1) that exits 1 at once")
    parser.add_argument("--fail_after_s", type=float, default=0.0, help="--fail's task exits after this much training")
    parser.add_argument("--stop_file", default=None, help="every worker stops training once this file exists")
    args = parser.parse_args()
    if args.fail and not args.fail_after_s and "TF_CONFIG" in os.environ and _this_task() == args.fail:
        print(f"{args.fail}: failing on purpose", flush=True)
        return 1
    return tfl.run_task(args, train)


def _this_task() -> str:
    _, task = tfl.from_tf_config(os.environ["TF_CONFIG"])
    return task.short


if __name__ == "__main__":
    sys.exit(main())
