"""The smallest job whose checkpoints can be checked exactly: two scalars, one on each of two ps, SGD lr 1, and a
loss whose gradient is 1 for both. Every push lowers both by 1, so a consistent checkpoint holds a == b ==
-(the updates each shard applied), and so does the fleet after a restore from one."""

import argparse
import sys
import time

import torch
from torch import nn

import tensorfleet as tfl


class TwoScalars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(()))  # round robin: ps 0
        self.b = nn.Parameter(torch.zeros(()))  # ps 1


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    model = TwoScalars()
    replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.sgd(lr=1.0))
    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=args.last_step)],
                             checkpoint_dir=args.checkpoint_dir, save_checkpoint_steps=args.save_steps,
                             max_to_keep=10_000, log_step_count_steps=None, summary_dir=False,
                             recovery_timeout_s=60) as session:
        while not session.should_stop():
            session.run_step(lambda: model.a + model.b)
            time.sleep(args.step_sleep_s)
    print(f"worker {cluster.replica_id(task)} finished at global step {session.global_step}, "
          f"recoveries {session.recoveries}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    tfl.add_cluster_flags(parser)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--last_step", type=int, default=4000)
    parser.add_argument("--save_steps", type=int, default=20)
    parser.add_argument("--step_sleep_s", type=float, default=0.002)
    return tfl.run_task(parser.parse_args(), train)


if __name__ == "__main__":
    sys.exit(main())
