"""Distributed MNIST by in-graph replication: one coordinator drives the workers, as TensorFlow 2's
``ParameterServerStrategy`` + ``ClusterCoordinator`` do. The model (the classic 784-100-10 MLP, Adam 0.01, batch
100, a moving average of decay 0.999 on the ps) and the data are those of ``mnist_mlp.py``; what changes is who
decides: the coordinator (the cluster's ``chief``) initializes the ps and schedules ``train_step`` closures,
each on whichever worker is free; each worker reads its own batches (``create_per_worker_dataset``: no batch
leaves the coordinator). Start it on a local cluster:

    tensorfleet launch --coordinator --ps 1 --workers 2 examples/mnist_coordinator.py

Every task runs this same script (``tfl.run_coordinated``): the ps serve, the workers run the closures they are
sent, the coordinator runs ``drive`` until the global step reaches ``--train_steps`` (its StopAtStepHook sees
the closures' steps), saving checkpoints with ``--checkpoint_dir``: a ps restarted empty is restored from the
latest, and a restarted coordinator takes up where the ps are. Asynchronous by default; with ``--sync`` every
closure runs on every worker, each step averaging the workers' gradients.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.data.mnist import Split, batches, load_mnist

from mnist_mlp import REPO_DATA, build_model  # the seed job's model and data: only the driving differs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tfl.add_cluster_flags(parser)
    tfl.add_training_flags(parser)
    parser.set_defaults(moving_average_decay=0.999)
    parser.add_argument("--data_dir", default=str(REPO_DATA), help="folder with the four MNIST IDX files")
    parser.add_argument("--train_steps", type=int, default=10000, help="stop when the global step reaches this")
    parser.add_argument("--steps_per_closure", type=int, default=50,
                        help="steps each scheduled closure runs on its worker (one round trip to the coordinator)")
    parser.add_argument("--checkpoint_dir", default=None,
                        help="the coordinator saves checkpoints here and restores from them (a restarted ps too)")
    parser.add_argument("--save_checkpoint_steps", type=int, default=None,
                        help="save a checkpoint every N global steps (default: every 600 s)")
    parser.add_argument("--batch_size", type=int, default=100)
    parser.add_argument("--learning_rate", type=float, default=0.01)
    parser.add_argument("--hidden_units", type=int, default=100)
    parser.add_argument("--train_limit", type=int, default=None, help="train on the first N examples only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--intra_op_threads", type=int, default=1, help="torch threads per process")
    return parser.parse_args(argv)


ARGS: argparse.Namespace  # every task parses the same command line (main)


def setup(cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> tfl.Replica:
    """Every task but the ps: the model and its replica (the coordinator's values initialize the ps)."""
    torch.manual_seed(ARGS.seed)
    optimizer = tfl.OptimizerSpec.adam(lr=ARGS.learning_rate)
    return tfl.Replica(build_model(ARGS.hidden_units), cluster, task, optimizer=optimizer,
                       **tfl.training_options(ARGS))


@tfl.remote
def worker_batches():
    """Runs on each worker: its own shuffled stream of training batches."""
    index = tfl.worker_context().replica.task.index
    return batches(load_mnist(ARGS.data_dir).train, ARGS.batch_size, seed=ARGS.seed * 1000 + index + 1,
                   limit=ARGS.train_limit)


@tfl.remote
def train_step(data, steps: int):
    """Runs on a worker: ``steps`` training steps on its own batches; returns the last loss."""
    context = tfl.worker_context()
    loss = None
    for _ in range(steps):
        images, labels = next(data)
        result = context.session.run_step(lambda: nn.functional.cross_entropy(context.model(images), labels),
                                          batch_size=len(labels))
        loss = result.loss
    return loss


@torch.no_grad()
def evaluate(model: nn.Module, split: Split) -> float:
    return (model(split.images).argmax(dim=1) == split.labels).float().mean().item()


def drive(coordinator: tfl.Coordinator, session: tfl.TrainingSession) -> None:
    """The coordinator: schedule closures until the global step reaches --train_steps, evaluate the ps' model."""
    data = coordinator.create_per_worker_dataset(worker_batches)
    start, first_step = time.time(), session.global_step
    print(f"Coordinator: training begins at global step {first_step}")
    closures: list[tfl.RemoteValue] = []
    while not coordinator.should_stop():  # schedule() waits while two closures per worker are pending
        closures.append(coordinator.schedule(train_step, args=(data, ARGS.steps_per_closure)))
    coordinator.join()
    elapsed = time.time() - start
    replica = session.replica
    step = replica.pull()
    workers = {worker for value in closures for worker in getattr(value, "workers", [value.worker])}
    last = evaluate(replica.module, load_mnist(ARGS.data_dir).test)
    print(f"Coordinator: {len(closures)} closure(s) of {ARGS.steps_per_closure} step(s) ran on {len(workers)} "
          f"worker(s); global step {first_step} -> {step}; last loss {losses_of(closures[-1]) if closures else '-'}")
    print(f"Training elapsed time: {elapsed:.2f} s")
    if replica.average_decay:
        replica.load_averages()
    test_accuracy = evaluate(replica.module, load_mnist(ARGS.data_dir).test)
    print(f"test accuracy: {test_accuracy:.4f} ({'moving average' if replica.average_decay else 'last parameters'})")
    tfl.report_metrics(accuracy=test_accuracy)  # the job's summary and pages show it
    print(f"test accuracy of the last parameters: {last:.4f}")


def losses_of(value: tfl.RemoteValue) -> str:
    """A closure's loss (async), or its workers' losses (sync: the closure ran on each)."""
    loss = value.fetch()
    return ", ".join(f"{x:.4f}" for x in loss) if isinstance(loss, list) else f"{loss:.4f}"


def main(argv: list[str] | None = None) -> int:
    global ARGS
    ARGS = parse_args(argv)
    hooks = [tfl.StopAtStepHook(last_step=ARGS.train_steps)]
    return tfl.run_coordinated(ARGS, setup, drive, intra_op_threads=ARGS.intra_op_threads,
                               session_options={"hooks": hooks, "checkpoint_dir": ARGS.checkpoint_dir,
                                                "save_checkpoint_steps": ARGS.save_checkpoint_steps})


if __name__ == "__main__":
    sys.exit(main())
