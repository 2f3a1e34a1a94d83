"""Distributed MNIST, the classic configuration: a 784-100-10 MLP trained by ps + workers.

Adam (lr 0.01) runs on the ps, batch 100, asynchronous updates (or --sync), and
every worker stops once the global step reaches 10,000.  The ps also keeps a
moving average of the parameters (decay 0.999), which is what the test accuracy
is measured on (the last parameters' accuracy is printed too; set
--moving_average_decay 0 to evaluate only those).  Start it on a local cluster:

    tensorfleet launch --ps 1 --workers 2 examples/mnist_mlp.py
    tensorfleet launch --ps 2 --workers 3 examples/mnist_mlp.py -- --sync --replicas_to_aggregate 2

or by hand, one terminal per task, like distributed TensorFlow:

    python examples/mnist_mlp.py --ps_hosts=127.0.0.1:2222 --worker_hosts=127.0.0.1:2223,127.0.0.1:2224 \
        --job_name=ps --task_index=0
    python examples/mnist_mlp.py ... --job_name=worker --task_index=0     (and --task_index=1)

or with TF_CONFIG set instead of the four cluster flags.  The chief writes TensorBoard
summaries (loss, learning rate, examples/sec; with --sync the dropped stale gradients)
to LOGDIR/train under the launcher (``--logdir LOGDIR``; then ``tensorboard --logdir
LOGDIR``), or to ``--summary_dir``.
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
    tfl.add_training_flags(parser)
    parser.set_defaults(moving_average_decay=0.999)  # evaluate the averaged parameters (0: the last ones)
    parser.add_argument("--data_dir", default=str(REPO_DATA), help="folder with the four MNIST IDX files")
    parser.add_argument("--train_steps", type=int, default=10000, help="stop when the global step reaches this")
    parser.add_argument("--batch_size", type=int, default=100)
    parser.add_argument("--learning_rate", type=float, default=0.01)
    parser.add_argument("--hidden_units", type=int, default=100)
    parser.add_argument("--log_every", type=int, default=1000, help="log a line every N local steps")
    parser.add_argument("--checkpoint_dir", default=None,
                        help="the chief saves checkpoints here and restores from them (a restarted ps too)")
    parser.add_argument("--save_checkpoint_steps", type=int, default=None,
                        help="save a checkpoint every N global steps (default: every 600 s)")
    parser.add_argument("--summary_dir", default=None,
                        help="the chief writes TensorBoard summaries here (default: LOGDIR/train under "
                             "tensorfleet launch, none by hand)")
    parser.add_argument("--train_limit", type=int, default=None, help="train on the first N examples only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--intra_op_threads", type=int, default=1, help="torch threads per process")
    return parser.parse_args(argv)


def build_model(hidden_units: int) -> nn.Module:
    """The classic MLP, initialized as Keras' Dense is (Glorot-uniform weights, zero biases)."""
    model = nn.Sequential(nn.Linear(784, hidden_units), nn.ReLU(), nn.Linear(hidden_units, 10))
    for layer in (model[0], model[2]):
        nn.init.xavier_uniform_(layer.weight)
        nn.init.zeros_(layer.bias)
    return model


@torch.no_grad()
def evaluate(model: nn.Module, split: Split) -> tuple[float, float]:
    """(mean cross entropy, accuracy) of the model on a whole split."""
    logits = model(split.images)
    loss = nn.functional.cross_entropy(logits, split.labels).item()
    accuracy = (logits.argmax(dim=1) == split.labels).float().mean().item()
    return loss, accuracy


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    mnist = load_mnist(args.data_dir)
    replica_id = cluster.replica_id(task)
    data = batches(mnist.train, args.batch_size, seed=args.seed * 1000 + replica_id, limit=args.train_limit)
    torch.manual_seed(args.seed)  # only the chief's initial values reach the ps
    model = build_model(args.hidden_units)
    optimizer = tfl.OptimizerSpec.adam(lr=args.learning_rate)
    replica = tfl.Replica(model, cluster, task, optimizer=optimizer, **tfl.training_options(args))
    # As MonitoredTrainingSession: stop at the global step, checkpoints (if asked) that a restarted ps is
    # restored from, a log line every --log_every local steps, TensorBoard summaries (the chief).
    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=args.train_steps)],
                             checkpoint_dir=args.checkpoint_dir, save_checkpoint_steps=args.save_checkpoint_steps,
                             log_step_count_steps=args.log_every, summary_dir=args.summary_dir) as session:
        start = time.time()
        print(f"Worker {replica_id}: training begins @ {start:f} at global step {session.global_step}")
        while not session.should_stop():
            images, labels = next(data)
            session.run_step(lambda: nn.functional.cross_entropy(model(images), labels), batch_size=len(labels))
        elapsed = time.time() - start
        step = replica.pull()
        _, last_accuracy = evaluate(model, mnist.test)
        if replica.average_decay:  # evaluate the moving average kept on the ps: less noisy than the last step
            replica.load_averages()
    print(f"Worker {replica_id}: done after {session.local_step} local step(s) (global step: {step}), "
          f"{replica.dropped_gradients} gradient(s) dropped by the ps, {session.recoveries} recoveries")
    print(f"Training elapsed time: {elapsed:.2f} s")
    val_loss, _ = evaluate(model, mnist.validation)
    print(f"After {step} training step(s), validation cross entropy = {val_loss:g}")
    _, test_accuracy = evaluate(model, mnist.test)
    evaluated = f"moving average, decay {replica.average_decay:g}" if replica.average_decay else "last parameters"
    print(f"test accuracy: {test_accuracy:.4f} ({evaluated})")
    tfl.report_metrics(accuracy=test_accuracy, val_cross_entropy=val_loss)  # the job's summary and pages show them
    if replica.average_decay:
        print(f"test accuracy of the last parameters: {last_accuracy:.4f}")
        print(f"  (each worker evaluates the parameters it pulled last, here at global step {step}"
              + ("; in async mode they differ from worker to worker by the updates in between)"
                 if replica.sync is None else ")"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return tfl.run_task(args, train, intra_op_threads=args.intra_op_threads)


if __name__ == "__main__":
    sys.exit(main())
