"""Hello, cluster: two variables on the ps, their product computed on the worker, until step 200.

``x = [[1, 2, 3, 4]]`` and ``w = [[2], [2], [2], [2]]`` live on the ps.  Each step
the worker pulls them, computes ``x @ w`` on its own device and prints it
(``[[20]]``), then pushes the gradient: the ps applies it with a learning rate of 0
(the values never change) and the global step advances, until a StopAtStepHook ends
training at step 200.  With ``--log_device_placement`` it says where each variable
lives and where the product ran.  Under the launcher the chief also writes TensorBoard
summaries (the loss, the learning rate, examples/sec) to LOGDIR/train: run it with
``--logdir LOGDIR`` and then ``tensorboard --logdir LOGDIR``.

    tensorfleet launch --ps 1 --workers 1 examples/hello_cluster.py -- --log_device_placement

or by hand, one terminal per task:

    python examples/hello_cluster.py --ps_hosts=127.0.0.1:2222 --worker_hosts=127.0.0.1:2223 \\
        --job_name=ps --task_index=0
    python examples/hello_cluster.py --ps_hosts=127.0.0.1:2222 --worker_hosts=127.0.0.1:2223 \\
        --job_name=worker --task_index=0 --log_device_placement
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
from torch import nn

import tensorfleet as tfl

log = logging.getLogger("hello_cluster")


class Hello(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
        self.w = nn.Parameter(torch.full((4, 1), 2.0))


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    model = Hello()
    replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.sgd(lr=0.0), **tfl.training_options(args))
    where = tfl.device(args.device, allow_soft_placement=args.allow_soft_placement)
    if args.log_device_placement:
        log.info("MatMul (x @ w): %s", tfl.device_name(where, job=task.job_name, task=task.index))

    def step() -> torch.Tensor:
        product = model.x.to(where) @ model.w.to(where)
        print(product.detach().round().int().tolist(), flush=True)
        return product.sum()

    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=args.last_step)],
                             log_step_count_steps=None) as session:
        while not session.should_stop():
            session.run_step(step, batch_size=1)
    print(f"{task.short}: done at global step {session.global_step}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tfl.add_cluster_flags(parser)
    tfl.add_training_flags(parser)
    parser.add_argument("--device", default="/cpu:0", help="where the worker computes x @ w, e.g. /gpu:0")
    parser.add_argument("--last_step", type=int, default=200, help="stop when the global step reaches this")
    args = parser.parse_args(argv)
    return tfl.run_task(args, train)


if __name__ == "__main__":
    sys.exit(main())
