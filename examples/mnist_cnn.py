"""Distributed MNIST with the classic two-conv-layer CNN, trained synchronously by ps + workers.

The network of TensorFlow's ``convolutional.py`` tutorial: conv 5x5x32 - max-pool -
conv 5x5x64 - max-pool - fully connected 512 with dropout 0.5 - softmax 10; L2
regularization (5e-4) on the fully connected layers; momentum 0.9 with a
learning rate decaying exponentially by 0.95 per epoch (on the ps, by global
step).  Sync mode by default: each step averages one batch per worker.

With ``--towers K`` each worker splits its batch over K devices of its machine (one
GPU each, or K processes on the CPU), averages their gradients locally and pushes
one gradient per step, as the classic multi-GPU example does; the log lines then
read ``step 120, loss = 0.53 (812.3 examples/sec; 0.158 sec/batch)`` per worker.

    tensorfleet launch --ps 2 --workers 2 examples/mnist_cnn.py
    tensorfleet launch --ps 2 --workers 2 examples/mnist_cnn.py -- --placement greedy --partitions 2
    tensorfleet launch --ps 1 --workers 2 --gpus-per-worker 4 examples/mnist_cnn.py -- --towers 4

The chief writes TensorBoard summaries (loss, learning rate, examples/sec, dropped stale
gradients) to LOGDIR/train under the launcher (``tensorboard --logdir LOGDIR``), or to
``--summary_dir``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.data.mnist import Split, batches, load_mnist

REPO_DATA = Path(__file__).resolve().parent.parent / "data" / "mnist"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tfl.add_cluster_flags(parser)
    tfl.add_training_flags(parser, default_mode="sync", towers=True)
    parser.set_defaults(moving_average_decay=0.999)  # evaluate the averaged parameters (0: the last ones)
    parser.add_argument("--data_dir", default=str(REPO_DATA), help="folder with the four MNIST IDX files")
    parser.add_argument("--num_epochs", type=float, default=10.0,
                        help="train for this many passes over the training set (as the classic example)")
    parser.add_argument("--train_steps", type=int, default=None,
                        help="stop when the global step reaches this (overrides --num_epochs)")
    parser.add_argument("--batch_size", type=int, default=64, help="examples per worker per step")
    parser.add_argument("--learning_rate", type=float, default=0.01, help="initial learning rate")
    parser.add_argument("--decay_rate", type=float, default=0.95, help="learning-rate decay per epoch")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--l2", type=float, default=5e-4, help="L2 regularization of the fully connected layers")
    parser.add_argument("--log_every", type=int, default=100, help="log a line every N local steps")
    parser.add_argument("--checkpoint_dir", default=None, help="save checkpoints here; restore from here on start")
    parser.add_argument("--save_checkpoint_steps", type=int, default=500)
    parser.add_argument("--summary_dir", default=None,
                        help="the chief writes TensorBoard summaries here (default: LOGDIR/train under "
                             "tensorfleet launch, none by hand)")
    parser.add_argument("--train_limit", type=int, default=None, help="train on the first N examples only")
    parser.add_argument("--eval_limit", type=int, default=None, help="evaluate on the first N examples of each split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--intra_op_threads", type=int, default=1, help="torch threads per process")
    return parser.parse_args(argv)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(7 * 7 * 64, 512)
        self.fc2 = nn.Linear(512, 10)
        self.dropout = nn.Dropout(0.5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.view(-1, 1, 28, 28)
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = self.dropout(torch.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)

    def l2_penalty(self) -> torch.Tensor:
        """As the classic example: (sum of squares / 2) over fc1 and fc2 weights and biases."""
        return sum(p.pow(2).sum() / 2 for layer in (self.fc1, self.fc2) for p in layer.parameters())


@torch.no_grad()
def accuracy(model: nn.Module, split: Split, batch: int = 1000, limit: int | None = None) -> float:
    split = Split(split.images[:limit], split.labels[:limit])
    model.eval()
    where = next(model.parameters()).device
    correct = sum((model(split.images[i:i + batch].to(where)).argmax(1).cpu() == split.labels[i:i + batch]).sum().item()
                  for i in range(0, len(split), batch))
    model.train()
    return correct / len(split)


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    options = tfl.TowerOptions.from_flags(args, job=task.job_name, task=task.index)
    tfl.run_towers(train_towers, args, cluster, task, options=options)


def train_towers(towers: tfl.Towers, args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    """One tower's training (every tower runs it; with one tower, the worker's own)."""
    mnist = load_mnist(args.data_dir)
    replica_id = cluster.replica_id(task)
    # Every tower of a worker draws the worker's batches and keeps its slice: K towers see the batch one would.
    data = batches(mnist.train, args.batch_size, seed=args.seed * 1000 + replica_id, limit=args.train_limit)
    # dropout differs per worker and tower; only the chief's tower 0 init reaches the ps
    torch.manual_seed(args.seed + replica_id * towers.num_towers + towers.index)
    model = ConvNet().to(towers.device)
    examples_per_step = args.batch_size * len(cluster.replicas)
    steps_per_epoch = max(1, len(mnist.train) // examples_per_step)
    if args.train_steps is None:
        args.train_steps = int(args.num_epochs * steps_per_epoch)
    decay = tfl.ExponentialDecay(decay_steps=steps_per_epoch, decay_rate=args.decay_rate, staircase=True)
    optimizer = tfl.OptimizerSpec.sgd(lr=args.learning_rate, momentum=args.momentum).with_schedule(decay)
    replica = tfl.TowerReplica(towers, model, cluster, task, optimizer=optimizer, **tfl.training_options(args))
    net = replica.model  # forward through it: its backward averages the towers' gradients
    lead = towers.index == 0  # tower 0 speaks for the worker: its log lines, its prints

    def loss_of(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(net(images), labels) + args.l2 * model.l2_penalty()

    start = time.time()
    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=args.train_steps)],
                             summary_dir=args.summary_dir, checkpoint_dir=args.checkpoint_dir,
                             save_checkpoint_steps=args.save_checkpoint_steps,
                             log_step_count_steps=args.log_every if lead else None) as session:
        if lead:
            print(f"Worker {replica_id}: training begins @ {start:f} at global step {session.global_step}"
                  + (f" on {towers.num_towers} towers" if towers.num_towers > 1 else ""))
        while not session.should_stop():
            images, labels = towers.split(*next(data))
            session.run_step(lambda: loss_of(images, labels), batch_size=args.batch_size)
        elapsed = time.time() - start
        step = replica.pull()  # pull and load_averages are steps of every tower: each one calls them
        last_accuracy = accuracy(model, mnist.test, limit=args.eval_limit) if lead else 0.0
        if args.moving_average_decay:  # evaluate the moving average kept on the ps, as the classic example does
            replica.load_averages()
    if not lead:
        return
    local_step = session.local_step
    print(f"Worker {replica_id}: done after {local_step} local step(s) (global step: {step}), "
          f"{replica.dropped_gradients} gradient(s) dropped by the ps")
    print(f"Training elapsed time: {elapsed:.2f} s")
    evaluated = f"moving average, decay {replica.average_decay:g}" if replica.average_decay else "last parameters"
    val_accuracy = accuracy(model, mnist.validation, limit=args.eval_limit)
    test_accuracy = accuracy(model, mnist.test, limit=args.eval_limit)
    print(f"validation accuracy: {val_accuracy:.4f} ({evaluated})")
    print(f"test accuracy: {test_accuracy:.4f} ({evaluated})")
    tfl.report_metrics(accuracy=test_accuracy, val_accuracy=val_accuracy)  # the job's summary and pages show them
    if replica.average_decay:
        print(f"test accuracy of the last parameters: {last_accuracy:.4f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return tfl.run_task(args, train, intra_op_threads=args.intra_op_threads)


if __name__ == "__main__":
    sys.exit(main())
