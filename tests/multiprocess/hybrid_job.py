"""A small hybrid job (dense by all-reduce, a table on the ps) in a TrainingSession, run as real processes by
test_hybrid_failures.py; each worker writes its dense values at the end to --out."""

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

import tensorfleet as tfl

ROWS, DIM = 1000, 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM + 4, 32), nn.ReLU(), nn.Linear(32, 2))
        self.table = tfl.EmbeddingTable("ids", DIM, num_rows=ROWS, pooling="sum",
                                        optimizer=tfl.OptimizerSpec("adagrad", {"lr": 0.05}))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.body(torch.cat([x, self.table(ids)], 1))


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    replica_id = cluster.replica_id(task)
    torch.manual_seed(0)
    model = Net()
    generator = torch.Generator().manual_seed(replica_id)
    replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.adam(lr=0.01), dense="allreduce",
                          init_timeout_s=args.init_timeout_s, mode=args.mode,
                          sync=tfl.SyncOptions(timeout_s=args.sync_timeout_s) if args.mode == "sync" else None)
    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=args.last_step)],
                             log_step_count_steps=None, summary_dir=False, recovery_timeout_s=60) as session:
        print(f"worker {replica_id} starts at global step {session.global_step}", flush=True)
        while not session.should_stop():
            x = torch.randn(32, 4, generator=generator)
            ids = torch.randint(0, ROWS, (32, 3), generator=generator)
            y = (x.sum(1) > 0).long()
            session.run_step(lambda: nn.functional.cross_entropy(model(x, ids), y))
        torch.save({n: p.detach() for n, p in model.body.named_parameters()},
                   Path(args.out) / f"worker-{replica_id}.pt")
    print(f"worker {replica_id} finished at global step {session.global_step}, "
          f"recoveries {session.recoveries}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    tfl.add_cluster_flags(parser)
    parser.add_argument("--out", required=True)
    parser.add_argument("--last_step", type=int, default=1500)
    parser.add_argument("--init_timeout_s", type=float, default=60.0)
    parser.add_argument("--mode", default="async")
    parser.add_argument("--sync_timeout_s", type=float, default=300.0)
    return tfl.run_task(parser.parse_args(), train)


if __name__ == "__main__":
    sys.exit(main())
