"""Distributed MNIST with a model's part on another task's device, as classic TensorFlow's in-graph example did with
``with tf.device("/job:worker/task:0")``: the chief holds the loop, the data and the hidden layer; the output layer
lives in worker 0's process; forward and backward cross processes as calls of the job's own authenticated wire
(``tensorfleet.coordinator.placement``: the worker builds ``nn.Linear`` by name; nothing is pickled). The model and
data are ``mnist_mlp.py``'s. Start it on a local cluster:

    tensorfleet launch --coordinator --ps 1 --workers 1 examples/mnist_placed.py

(the ps takes no part and exits; the chief drives, the worker serves its layer). Every step moves the activations at
the cut and their gradients; between-graph replication (``mnist_mlp.py``) is faster here, as
``benchmarks/remote_placement.py`` measures: placement is for a model one machine cannot hold.

The chief saves a checkpoint every ``--save_checkpoint_steps`` steps (the model, its placed layer included, and the
step) to ``--checkpoint_dir`` (under the launcher: ``LOGDIR/checkpoints`` by default); a chief the launcher starts
again after a crash resumes from it (the data where it was; Adam's moments start afresh), and says from where.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster.environment import LOGDIR_ENV
from tensorfleet.coordinator.placement import (distributed_optimizer, place_module, restore_checkpoint, run_placed,
                                               save_checkpoint, train_step)
from tensorfleet.data.mnist import batches, load_mnist

from mnist_mlp import REPO_DATA, build_model  # the seed job's model and data


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tfl.add_cluster_flags(parser)
    parser.add_argument("--data_dir", default=str(REPO_DATA), help="folder with the four MNIST IDX files")
    parser.add_argument("--train_steps", type=int, default=3000)
    parser.add_argument("--batch_size", type=int, default=100)
    parser.add_argument("--learning_rate", type=float, default=0.01)
    parser.add_argument("--device", default="/job:worker/task:0/device:CPU:0",
                        help="where the output layer lives")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint_dir", default=_default_checkpoint_dir(),
                        help="save checkpoints here, and resume from the last one (default: LOGDIR/checkpoints under "
                             "tensorfleet launch, none by hand)")
    parser.add_argument("--save_checkpoint_steps", type=int, default=500, help="save a checkpoint every N steps")
    return parser.parse_args(argv)


def _default_checkpoint_dir() -> str | None:
    logdir = os.environ.get(LOGDIR_ENV)
    return os.path.join(logdir, "checkpoints") if logdir else None


ARGS: argparse.Namespace


def drive(group: tfl.RpcGroup) -> None:
    """The chief: the seed model with its output layer placed on ``--device``, trained with Adam across the
    processes (from the last checkpoint, if there is one); then evaluated."""
    torch.manual_seed(ARGS.seed)
    local = build_model(100)  # the same initial values as the seed job
    output = place_module(ARGS.device, nn.Linear, 100, 10)
    output.load_state_dict(local[2].state_dict())
    model = nn.Sequential(local[0], local[1], output)
    resumed = restore_checkpoint(model, ARGS.checkpoint_dir) if ARGS.checkpoint_dir else None
    if resumed is None:
        where = f"no checkpoint in {ARGS.checkpoint_dir}" if ARGS.checkpoint_dir else "no --checkpoint_dir"
        print(f"training from step 0 ({where})", flush=True)
    else:
        print(f"resuming from the checkpoint of step {resumed} in {ARGS.checkpoint_dir}", flush=True)
    group.set_progress(target_step=ARGS.train_steps)
    optimizer = distributed_optimizer(torch.optim.Adam, model, lr=ARGS.learning_rate)
    mnist = load_mnist(ARGS.data_dir)
    data = itertools.islice(batches(mnist.train, ARGS.batch_size, seed=ARGS.seed), group.global_step, None)
    first, start = group.global_step, time.time()
    while group.global_step < ARGS.train_steps:
        images, labels = next(data)
        loss = train_step(lambda: nn.functional.cross_entropy(model(images), labels), optimizer)
        step = group.global_step
        if step % 1000 == 0:
            print(f"step {step}: loss {float(loss):.4f}", flush=True)
        if ARGS.checkpoint_dir and (step % ARGS.save_checkpoint_steps == 0 or step == ARGS.train_steps):
            save_checkpoint(model, ARGS.checkpoint_dir, step)
    elapsed = time.time() - start
    print(f"Training elapsed time: {elapsed:.2f} s ({(group.global_step - first) / max(elapsed, 1e-9):.0f} steps/s; "
          f"output layer on {output.owner})")
    with torch.no_grad():
        accuracy = (model(mnist.test.images).argmax(dim=1) == mnist.test.labels).float().mean().item()
    print(f"test accuracy: {accuracy:.4f}")


def main(argv: list[str] | None = None) -> int:
    global ARGS
    ARGS = parse_args(argv)
    return run_placed(ARGS, drive)


if __name__ == "__main__":
    sys.exit(main())
