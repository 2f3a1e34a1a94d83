"""Towers in real processes, for the tower tests: local training, a worker of a ps job, or a hang.

    towers_job.py local  --towers K --steps N --out F    K towers, SGD on every tower; each writes F.<tower>
    towers_job.py hybrid --towers K --steps N --out F    a worker of the job in TF_CONFIG (sync or async),
                                                         driven by a TrainingSession; each tower writes F.<tower>
    towers_job.py tables --towers K --steps N --out F    a sync worker whose model has an embedding table
                                                         (TableNet); each tower writes F.<tower>, rows included
    towers_job.py hang   --towers K                      towers that wait forever (tower 0 prints the pids)

``--fail_tower k`` makes tower k raise at step 2 of ``local``; TOWERS_JOB_FAIL_ON_SPAWN=1 makes every
spawned tower exit 3 while importing this script, before it reaches the rendezvous.

The model and the batches are those of ``batch_for``: the test computes the same training
in one process on the full batch and compares.
"""

import argparse
import os
import sys
import time

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.testing.models import seeded_mlp

BATCH, FEATURES, CLASSES, LR = 8, 12, 3, 0.1

if __name__ == "__mp_main__" and os.environ.get("TOWERS_JOB_FAIL_ON_SPAWN"):
    sys.exit(3)  # a spawned tower imports the script as __mp_main__: this one never gets to the rendezvous


def make_model() -> nn.Module:
    return seeded_mlp(FEATURES, 16, CLASSES, scale=0.3)


def batch_for(step: int, worker: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(BATCH, FEATURES, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator)


def save(towers: tfl.Towers, model: nn.Module, out: str, **extra: int) -> None:
    state = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    torch.save({"params": state, "pid": os.getpid(), **extra}, f"{out}.{towers.index}")


def local(towers: tfl.Towers, args: argparse.Namespace) -> None:
    model = make_model().to(towers.device)
    net = towers.wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(args.steps):
        if towers.index == args.fail_tower and step == 2:
            raise RuntimeError(f"tower {towers.index} fails on purpose")
        x, y = towers.split(*batch_for(step))
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    save(towers, model, args.out)


def hybrid(towers: tfl.Towers, args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    model = make_model().to(towers.device)
    replica = tfl.TowerReplica(towers, model, cluster, task, optimizer=tfl.OptimizerSpec.sgd(lr=LR),
                               init_timeout_s=args.init_timeout_s, **tfl.training_options(args))
    worker = cluster.replica_id(task)
    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=args.steps)],
                             log_step_count_steps=None) as session:
        while not session.should_stop():
            x, y = towers.split(*batch_for(session.global_step, worker))
            forward = replica.model if args.through == "ddp" else model
            session.run_step(lambda: nn.functional.cross_entropy(forward(x), y), batch_size=BATCH)
        replica.pull()  # every tower takes the final values
        save(towers, model, args.out, local_steps=session.local_step, global_step=replica.global_step)


TABLE_IDS = torch.tensor([5, -7, 2 ** 40, 11, 3, 99])  # any int64; each batch repeats some
TABLE_INIT = tfl.RowInitializer.normal(0.3, seed=1)
TABLE_LR = 0.3


class TableNet(nn.Module):
    """An embedding table (rows on the ps) beside the dense MLP of ``make_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = tfl.EmbeddingTable("t", 4, optimizer=tfl.OptimizerSpec("sgd", {"lr": TABLE_LR}),
                                        initializer=TABLE_INIT)
        self.head = seeded_mlp(4 + FEATURES, 16, CLASSES, scale=0.3)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.table(ids), x], dim=1))


def table_batch_for(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = batch_for(step)
    ids = TABLE_IDS[torch.randint(0, len(TABLE_IDS), (BATCH,), generator=torch.Generator().manual_seed(step))]
    return ids, x, y


def tables(towers: tfl.Towers, args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    model = TableNet().to(towers.device)
    replica = tfl.TowerReplica(towers, model, cluster, task, optimizer=tfl.OptimizerSpec.sgd(lr=LR),
                               init_timeout_s=args.init_timeout_s, **tfl.training_options(args))
    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=args.steps)],
                             log_step_count_steps=None) as session:
        while not session.should_stop():
            ids, x, y = towers.split(*table_batch_for(session.global_step))
            session.run_step(lambda: nn.functional.cross_entropy(replica.model(ids, x), y), batch_size=BATCH)
        replica.pull()
        with torch.no_grad():  # every tower asks (a collective): the rows as the ps holds them now
            rows = model.table(TABLE_IDS.to(towers.device)).cpu()
        state = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
        torch.save({"params": state, "rows": rows, "pid": os.getpid(), "global_step": replica.global_step},
                   f"{args.out}.{towers.index}")


def hang(towers: tfl.Towers, args: argparse.Namespace) -> None:
    towers.barrier()  # every tower is up
    if towers.index == 0:
        print("towers up", flush=True)
    while True:
        time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["local", "hybrid", "tables", "hang"])
    tfl.add_cluster_flags(parser)
    tfl.add_training_flags(parser, towers=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--init_timeout_s", type=float, default=60.0, help="how long tower 0 waits for the ps")
    parser.add_argument("--fail_tower", type=int, default=None, help="this tower raises at step 2 (local)")
    parser.add_argument("--through", choices=["ddp", "module"], default="ddp",
                        help="forward through replica.model (DDP) or the bare module (push then averages)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = tfl.TowerOptions.from_flags(args)
    if args.role == "local":
        tfl.run_towers(local, args, options=options)
    elif args.role == "hang":
        tfl.run_towers(hang, args, options=options)
    else:
        def train(args, cluster, task):
            options = tfl.TowerOptions.from_flags(args, job=task.job_name, task=task.index)
            tfl.run_towers(tables if args.role == "tables" else hybrid, args, cluster, task, options=options)
        return tfl.run_task(args, train)
    return 0


if __name__ == "__main__":
    sys.exit(main())
