"""A paced asynchronous job for the scaling tests: a TrainingSession loop, as a real script writes it.

A tiny linear model on random data; each worker sleeps ``--step_sleep_s`` per step so the
job lasts while a test scales it.  Training ends when the global step reaches the number
in ``--last_step_file`` (written by the test once it has seen what it wants; until then
the job runs, bounded by the test's own deadline), and a worker scaled away leaves through
``session.should_stop()``.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

import tensorfleet as tfl


def last_step(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):  # not written yet, or being written
        return None


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.sgd(lr=0.01),
                          **tfl.training_options(args))
    generator = torch.Generator().manual_seed(cluster.replica_id(task))

    def step() -> torch.Tensor:
        x = torch.randn(16, 8, generator=generator)
        return nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))

    with tfl.TrainingSession(replica, log_step_count_steps=None, summary_dir=False) as session:
        print(f"{task.short} starts at global step {replica.global_step}", flush=True)
        while not session.should_stop():
            end = last_step(args.last_step_file)
            if end is not None and session.global_step >= end:
                break
            session.run_step(step, batch_size=16)
            time.sleep(args.step_sleep_s)
    print(f"{task.short} done at global step {session.global_step} after {session.local_step} step(s)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    tfl.add_cluster_flags(parser)
    tfl.add_training_flags(parser)
    parser.add_argument("--last_step_file", type=Path, required=True)
    parser.add_argument("--step_sleep_s", type=float, default=0.02)
    return tfl.run_task(parser.parse_args(), train)


if __name__ == "__main__":
    sys.exit(main())
