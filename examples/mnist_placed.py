"""Distributed MNIST with a model's part on another task's device, as classic TensorFlow's in-graph example did with
``with tf.device("/job:worker/task:0")``: the chief holds the loop, the data and the hidden layer; the output layer
lives in worker 0's process; forward and backward cross processes (torch's RPC and distributed autograd, through
``tensorfleet.coordinator.placement``). The model and data are ``mnist_mlp.py``'s. Start it on a local cluster:

    tensorfleet launch --coordinator --ps 1 --workers 1 examples/mnist_placed.py

(the ps takes no part and exits; the chief drives, the worker serves its layer). Every step moves the activations at
the cut and their gradients; between-graph replication (``mnist_mlp.py``) is faster here, as
``benchmarks/remote_placement.py`` measures: placement is for a model one machine cannot hold.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.coordinator.placement import distributed_optimizer, place_module, run_placed, train_step
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
    return parser.parse_args(argv)


ARGS: argparse.Namespace


def drive(group: tfl.RpcGroup) -> None:
    """The chief: the seed model with its output layer placed on ``--device``, trained with Adam through
    distributed autograd; then evaluated."""
    torch.manual_seed(ARGS.seed)
    local = build_model(100)  # the same initial values as the seed job
    output = place_module(ARGS.device, nn.Linear, 100, 10)
    output.load_state_dict(local[2].state_dict())
    model = nn.Sequential(local[0], local[1], output)
    optimizer = distributed_optimizer(torch.optim.Adam, model, lr=ARGS.learning_rate)
    mnist = load_mnist(ARGS.data_dir)
    data = batches(mnist.train, ARGS.batch_size, seed=ARGS.seed)
    start = time.time()
    for step in range(1, ARGS.train_steps + 1):
        images, labels = next(data)
        loss = train_step(lambda: nn.functional.cross_entropy(model(images), labels), optimizer)
        if step % 1000 == 0:
            print(f"step {step}: loss {float(loss):.4f}", flush=True)
    elapsed = time.time() - start
    print(f"Training elapsed time: {elapsed:.2f} s ({ARGS.train_steps / elapsed:.0f} steps/s; output layer on "
          f"{output.owner})")
    with torch.no_grad():
        accuracy = (model(mnist.test.images).argmax(dim=1) == mnist.test.labels).float().mean().item()
    print(f"test accuracy: {accuracy:.4f}")


def main(argv: list[str] | None = None) -> int:
    global ARGS
    ARGS = parse_args(argv)
    return run_placed(ARGS, drive)


if __name__ == "__main__":
    sys.exit(main())
