"""A small model with an embedding table in a TrainingSession, run under the launcher by the ps-kill test.

An ``EmbeddingTable`` (growing, any int64 id, Adagrad per row) and a dense head learn a fixed
target per id.  The ids are a fixed set of ``UNIVERSE`` values spread over the whole int64 range
(the extremes included), so that rows live on every shard; every batch repeats some of them.
Each step sleeps ``--step_sleep_s`` so that the job lasts long enough to kill a ps mid-run
without loading the CPU.  The chief checkpoints every ``--save_steps`` global steps (keeping
every checkpoint, so the test can read the one a restarted ps was restored from).
"""

import argparse
import sys
import time

import torch
from torch import nn

import tensorfleet as tfl

DIM = 4
BATCH = 16
# 48 ids over the whole int64 range: the extremes, small ones, negative ones, and a spread of large ones.
UNIVERSE = torch.tensor([2 ** 63 - 1, -2 ** 63, 0, 1, -1, 7, 2 ** 40 + 3, -(2 ** 52)]
                        + [((k * 0x9E3779B97F4A7C15) % 2 ** 64) - 2 ** 63 for k in range(1, 41)], dtype=torch.int64)
TABLE_OPTIMIZER = tfl.OptimizerSpec("adagrad", {"lr": 0.1})
INITIALIZER = tfl.RowInitializer.normal(0.1, seed=5)


def build_model() -> nn.Module:
    torch.manual_seed(0)  # only the chief's initial dense values reach the ps
    return nn.ModuleDict({
        "item": tfl.EmbeddingTable("item", DIM, optimizer=TABLE_OPTIMIZER, initializer=INITIALIZER),
        "head": nn.Sequential(nn.Linear(DIM, 8), nn.Tanh(), nn.Linear(8, 1)),
    })


def target(ids: torch.Tensor) -> torch.Tensor:
    """A fixed target in [-1, 1] per id (its residue mod 17), which only a row per id can learn."""
    return ((ids % 17).float() - 8.0) / 8.0


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    replica_id = cluster.replica_id(task)
    generator = torch.Generator().manual_seed(replica_id)
    model = build_model()
    replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.sgd(lr=0.05))
    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=args.last_step)],
                             checkpoint_dir=args.checkpoint_dir, save_checkpoint_steps=args.save_steps,
                             max_to_keep=1000, log_step_count_steps=None, recovery_timeout_s=60) as session:
        print(f"worker {replica_id} starts at global step {session.global_step}", flush=True)
        loss = float("nan")
        while not session.should_stop():
            ids = UNIVERSE[torch.randint(0, len(UNIVERSE), (BATCH,), generator=generator)]

            def closure(ids=ids):
                prediction = model["head"](model["item"](ids)).squeeze(1)
                return nn.functional.mse_loss(prediction, target(ids))

            loss = session.run_step(closure).loss
            time.sleep(args.step_sleep_s)
    print(f"worker {replica_id} finished at global step {session.global_step}, "
          f"recoveries {session.recoveries}, loss {loss:.4f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    tfl.add_cluster_flags(parser)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--last_step", type=int, default=400)
    parser.add_argument("--save_steps", type=int, default=20)
    parser.add_argument("--step_sleep_s", type=float, default=0.01)
    return tfl.run_task(parser.parse_args(), train)


if __name__ == "__main__":
    sys.exit(main())
