"""MovieLens-100K rating prediction with embedding tables on the ps: users, items, genres, occupations.

The model is a factorization machine with a small dense tower: a user is the sum of the rows of
their id, occupation, age group and gender, a movie the row of its id plus the mean of its
genres' rows, and the predicted rating is

    mean rating + user bias + item bias + <user, movie> + tower([user, movie])

Every row lives on the ps in an ``EmbeddingTable`` (Adagrad per row, the classic choice for
embeddings); the tower is dense (Adam).  Training is synchronous by default: every step
touches the few rows all users share (2 genders, 7 age groups, 21 occupations), and in
async mode each worker's gradient lands on rows the other one has moved since (measured:
5-fold RMSE 0.9175 async, 0.9131 sync; see docs/tables.md); ``--async`` still works.  One fold
of a 5-fold cross-validation (Surprise's KFold, seed 0) is trained per run;
``benchmarks/movielens_cv.py`` runs the five and averages the RMSE.

The data come from the ``recbole==1.2.1`` wheel (its licence forbids redistribution, so it is
fetched, not committed).  Once per machine, then on a local cluster:

    tensorfleet data fetch movielens
    tensorfleet launch --ps 2 --workers 2 examples/movielens.py -- --fold 0
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.data import movielens

USER_FEATURES = ("user", "occupation", "age_bucket", "gender")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tfl.add_cluster_flags(parser)
    tfl.add_training_flags(parser, default_mode="sync")
    parser.add_argument("--fold", type=int, default=0, help="which of the 5 folds is the test set (0..4)")
    parser.add_argument("--epochs", type=float, default=5.0,
                        help="passes over the training folds, all workers together")
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--dim", type=int, default=32, help="embedding width")
    parser.add_argument("--table_learning_rate", type=float, default=0.08, help="Adagrad, per row")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="Adam, the dense tower")
    parser.add_argument("--l2", type=float, default=0.1, help="weight of the squared norm of the user and movie "
                                                                "vectors in the loss")
    parser.add_argument("--data_cache", default=None, help="where 'tensorfleet data fetch movielens' put the wheel")
    parser.add_argument("--log_every", type=int, default=200)
    parser.add_argument("--checkpoint_dir", default=None)
    parser.add_argument("--save_checkpoint_steps", type=int, default=None)
    parser.add_argument("--intra_op_threads", type=int, default=1)
    return parser.parse_args(argv)


class RatingModel(nn.Module):
    """A factorization machine over id features, with a dense tower on the two vectors."""

    def __init__(self, dim: int, table_lr: float, mean_rating: float) -> None:
        super().__init__()
        adagrad = tfl.OptimizerSpec("adagrad", {"lr": table_lr})
        normal = tfl.RowInitializer.normal(0.01)
        self.embeddings = nn.ModuleDict({name: tfl.EmbeddingTable(name, dim, optimizer=adagrad, initializer=normal)
                                         for name in (*USER_FEATURES, "item")})
        self.genres = tfl.EmbeddingTable("genre", dim, pooling="mean", optimizer=adagrad, initializer=normal)
        zero = tfl.RowInitializer.constant(0.0)
        self.user_bias = tfl.EmbeddingTable("user_bias", 1, optimizer=adagrad, initializer=zero)
        self.item_bias = tfl.EmbeddingTable("item_bias", 1, optimizer=adagrad, initializer=zero)
        self.tower = nn.Sequential(nn.Linear(2 * dim, 32), nn.ReLU(), nn.Linear(32, 1))
        self.register_buffer("mean_rating", torch.tensor(mean_rating))

    def forward(self, features: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted ratings, mean squared norm of the user and movie vectors: the L2 term)."""
        user = sum(self.embeddings[name](features[name]) for name in USER_FEATURES)
        movie = self.embeddings["item"](features["item"]) + self.genres(features["genre_ids"],
                                                                        features["genre_offsets"])
        rating = (self.mean_rating + self.user_bias(features["user"]).squeeze(1)
                  + self.item_bias(features["item"]).squeeze(1) + (user * movie).sum(1)
                  + self.tower(torch.cat([user, movie], dim=1)).squeeze(1))
        return rating, (user.pow(2).sum(1) + movie.pow(2).sum(1)).mean()


def as_tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def batches(data: movielens.MovieLens, rows: np.ndarray, batch_size: int, *, worker: int, num_workers: int,
            seed: int):
    """This worker's share of each epoch (a fresh shuffle per epoch), forever."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(rows)[worker::num_workers]
        for start in range(0, len(order) - batch_size + 1, batch_size):
            index = order[start:start + batch_size]
            yield as_tensors(data.rating_features(index)), torch.from_numpy(data.rating[index])


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    data = movielens.load(args.data_cache)
    train_rows, test_rows = movielens.kfold(len(data), 5, seed=0)[args.fold]
    replica_id, num_workers = cluster.replica_id(task), len(cluster.replicas)
    torch.manual_seed(0)  # the tower's initial values: only the chief's reach the ps
    model = RatingModel(args.dim, args.table_learning_rate, float(data.rating[train_rows].mean()))
    replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.adam(lr=args.learning_rate),
                          **tfl.training_options(args))
    per_step = args.batch_size * (replica.sync.replicas_to_aggregate if replica.sync else 1)  # examples
    last_step = int(args.epochs * len(train_rows) / per_step)
    stream = batches(data, train_rows, args.batch_size, worker=replica_id, num_workers=num_workers,
                     seed=1000 * args.fold + replica_id)

    def loss() -> torch.Tensor:
        features, ratings = next(stream)
        replica.prefetch_rows({"user": features["user"], "occupation": features["occupation"],  # all 8 tables'
                               "age_bucket": features["age_bucket"], "gender": features["gender"],  # rows in one
                               "item": features["item"], "genre": features["genre_ids"],  # request per ps
                               "user_bias": features["user"], "item_bias": features["item"]})
        predicted, norms = model(features)
        return F.mse_loss(predicted, ratings) + args.l2 * norms

    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=last_step)],
                             checkpoint_dir=args.checkpoint_dir, save_checkpoint_steps=args.save_checkpoint_steps,
                             log_step_count_steps=args.log_every) as session:
        start = time.time()
        while not session.should_stop():
            session.run_step(loss, batch_size=args.batch_size)
        elapsed = time.time() - start
        replica.pull()
        with torch.no_grad():  # the rows of the test users and movies, as the ps holds them now
            predicted, _ = model(as_tensors(data.rating_features(test_rows)))
        rmse = F.mse_loss(predicted.clamp(1, 5), torch.from_numpy(data.rating[test_rows])).sqrt().item()
    print(f"Worker {replica_id}: {session.local_step} local steps in {elapsed:.1f} s "
          f"(global step {replica.global_step} of {last_step})")
    print(f"fold {args.fold} test RMSE: {rmse:.4f} ({len(test_rows)} ratings)")
    tfl.report_metrics(rmse=rmse)  # the job's summary and pages show it


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return tfl.run_task(args, train, intra_op_threads=args.intra_op_threads)


if __name__ == "__main__":
    sys.exit(main())
