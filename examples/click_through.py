"""Click-through prediction at scale: Zipf-distributed ids over 10 million distinct ids in 4 tables.

The data are synthetic and made on the fly (``tensorfleet.data.synthetic_ctr``: no files): a
user, an item and a category id per sample and a bag of 1-5 tag ids, every id an arbitrary
int64, popular ids far more frequent than the rest (Zipf, exponent ~1.1), and a click drawn
from a hidden model of the ids, so that AUC means something (the hidden model's own AUC is
about 0.82; a constant guess gets 0.5).  Each feature has an ``EmbeddingTable`` (rows on the
ps, Adagrad per row; the tags' table mean-pools its bag) and a small MLP tower sits on their
rows.  The tables start empty and grow as ids arrive: the ps's Status (and the dashboard)
shows their rows.

    tensorfleet launch --ps 2 --workers 2 examples/click_through.py
    tensorfleet launch --ps 2 --workers 2 --dashboard 8080 examples/click_through.py -- --train_steps 5000
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.data.synthetic_ctr import CtrBatch, CtrSpec, auc, batch as ctr_batch

EVAL_WORKER = 1_000_000  # held-out batches: a worker index no training task uses
HIDDEN = (64, 32)

# A batch as the model takes it: {feature: (ids, bag offsets or None)}, and the labels.
Features = dict[str, tuple[torch.Tensor, torch.Tensor | None]]
Batch = tuple[Features, torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tfl.add_cluster_flags(parser)
    tfl.add_training_flags(parser)
    parser.add_argument("--table_size", type=int, default=10_000_000, help="distinct ids over all tables")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--train_steps", type=int, default=2000, help="stop when the global step reaches this")
    parser.add_argument("--table_learning_rate", type=float, default=0.05, help="Adagrad, per row")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="Adam, the tower")
    parser.add_argument("--eval_batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="the synthetic world")
    parser.add_argument("--log_every", type=int, default=200)
    parser.add_argument("--checkpoint_dir", default=None)
    parser.add_argument("--save_checkpoint_steps", type=int, default=None)
    parser.add_argument("--intra_op_threads", type=int, default=1)
    return parser.parse_args(argv)


class CtrModel(nn.Module):
    """A table per feature (any module taking ``ids``, or ``ids, offsets`` for a bag) and a tower on their rows."""

    def __init__(self, spec: CtrSpec, dim: int, tables: dict[str, nn.Module], *, seed: int = 0) -> None:
        super().__init__()
        self.names = [table.name for table in spec.tables]
        self.tables = nn.ModuleDict({name: tables[name] for name in self.names})
        generator = torch.Generator().manual_seed(seed)  # the same tower wherever it is built
        layers: list[nn.Module] = []
        width = dim * len(self.names)
        for hidden in HIDDEN:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.tower = nn.Sequential(*layers, nn.Linear(width, 1))
        with torch.no_grad():
            for layer in self.tower:
                if isinstance(layer, nn.Linear):
                    bound = 1.0 / layer.in_features ** 0.5
                    layer.weight.uniform_(-bound, bound, generator=generator)
                    layer.bias.uniform_(-bound, bound, generator=generator)

    def forward(self, features: Features) -> torch.Tensor:
        rows = [self.tables[name](ids) if offsets is None else self.tables[name](ids, offsets)
                for name, (ids, offsets) in ((name, features[name]) for name in self.names)]
        return self.tower(torch.cat(rows, dim=1)).squeeze(1)


def fleet_model(spec: CtrSpec, dim: int, table_lr: float) -> CtrModel:
    """The model with ``EmbeddingTable`` layers: rows on the ps by int64 id, Adagrad per row there."""
    adagrad = tfl.OptimizerSpec("adagrad", {"lr": table_lr})
    return CtrModel(spec, dim, {t.name: tfl.EmbeddingTable(t.name, dim, optimizer=adagrad,
                                                           pooling="mean" if t.ids_per_sample > 1 else None)
                                for t in spec.tables})


def as_batch(raw: CtrBatch, ids_of=lambda name, ids: ids) -> Batch:
    """A synthetic batch as tensors; ``ids_of(feature, ids)`` may map the ids (a benchmark's dense tables)."""
    features: Features = {name: (torch.from_numpy(ids_of(name, f.ids)),
                                 None if f.offsets is None else torch.from_numpy(f.offsets))
                          for name, f in raw.features.items()}
    return features, torch.from_numpy(raw.labels)


def held_out(spec: CtrSpec, batches: int, batch_size: int) -> tuple[list[CtrBatch], float]:
    """Held-out batches (a worker index no task trains on), and the hidden model's AUC on them."""
    raw = [ctr_batch(spec, worker=EVAL_WORKER, step=step, batch_size=batch_size) for step in range(batches)]
    return raw, auc(np.concatenate([b.true_logits for b in raw]), np.concatenate([b.labels for b in raw]))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch]) -> float:
    scores = [model(features).numpy() for features, _ in batches]
    return auc(np.concatenate(scores), np.concatenate([labels.numpy() for _, labels in batches]))


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    spec = CtrSpec.default(args.table_size, seed=args.seed)
    replica_id = cluster.replica_id(task)
    model = fleet_model(spec, args.dim, args.table_learning_rate)
    replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.adam(lr=args.learning_rate),
                          **tfl.training_options(args))
    local_step = 0

    def loss() -> torch.Tensor:
        nonlocal local_step
        features, labels = as_batch(ctr_batch(spec, worker=replica_id, step=local_step, batch_size=args.batch_size))
        local_step += 1
        replica.prefetch_rows({name: ids for name, (ids, _) in features.items()})  # one request per ps shard
        return nn.functional.binary_cross_entropy_with_logits(model(features), labels)

    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=args.train_steps)],
                             checkpoint_dir=args.checkpoint_dir, save_checkpoint_steps=args.save_checkpoint_steps,
                             log_step_count_steps=args.log_every) as session:
        start = time.time()
        while not session.should_stop():
            session.run_step(loss, batch_size=args.batch_size)
        elapsed = time.time() - start
        print(f"Worker {replica_id}: {session.local_step} local steps in {elapsed:.1f} s "
              f"({session.local_step * args.batch_size / elapsed:,.0f} samples/s)")
        if replica.is_chief:
            replica.pull()
            raw, bayes = held_out(spec, args.eval_batches, args.batch_size)
            held_out_auc = evaluate(model, [as_batch(b) for b in raw])
            print(f"held-out AUC: {held_out_auc:.4f} (the hidden model's: {bayes:.4f}; a constant guess: 0.5)")
            tfl.report_metrics(auc=held_out_auc)  # the job's summary and pages show it
            for status in replica.client.wait_for_shards(60):
                rows = ", ".join(f"{name} {t.rows:,.0f}" for name, t in (status.tables or {}).items())
                print(f"{status.task}: rows {rows}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return tfl.run_task(args, train, intra_op_threads=args.intra_op_threads)


if __name__ == "__main__":
    sys.exit(main())
