"""A small MNIST job in a TrainingSession, run as real processes by the kill-and-restart tests."""

import argparse
import sys

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.data.mnist import batches, load_mnist


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    mnist = load_mnist()
    replica_id = cluster.replica_id(task)
    data = batches(mnist.train, 50, seed=replica_id, limit=5000)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
    options = tfl.WireOptions(deadline_s=args.deadline_s) if args.deadline_s else None
    replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.adam(lr=0.01), mode=args.mode,
                          wire=options)
    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=args.last_step)],
                             checkpoint_dir=args.checkpoint_dir, save_checkpoint_steps=args.save_steps,
                             log_step_count_steps=None, recovery_timeout_s=60) as session:
        print(f"worker {replica_id} starts at global step {session.global_step}", flush=True)
        while not session.should_stop():
            images, labels = next(data)
            session.run_step(lambda: nn.functional.cross_entropy(model(images), labels))
        replica.pull()
        with torch.no_grad():
            accuracy = (model(mnist.test.images).argmax(1) == mnist.test.labels).float().mean().item()
    print(f"worker {replica_id} finished at global step {session.global_step}, "
          f"recoveries {session.recoveries}, test accuracy {accuracy:.4f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    tfl.add_cluster_flags(parser)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--last_step", type=int, default=3000)
    parser.add_argument("--save_steps", type=int, default=200)
    parser.add_argument("--mode", default="async")
    parser.add_argument("--deadline_s", type=float, default=None, help="each RPC's deadline (default: 60 s)")
    return tfl.run_task(parser.parse_args(), train)


if __name__ == "__main__":
    sys.exit(main())
