"""Online learning on MovieLens-100K: ratings replayed in time order, each predicted before it is trained on.

The ratings are sorted by timestamp.  The first ``--history`` of them are the past: trained on
in shuffled passes, as a model is before it is deployed.  At the end of the history the chief
saves a full checkpoint (the deployed model), and the rest is a stream: every step, each worker
takes the next ``--stream_batch`` ratings in time order, predicts them with the model as the ps
holds it now, then trains on them (prequential evaluation: every rating is predicted before it
is learnt from).  Every ``--delta_every`` stream steps the chief saves a delta checkpoint (the
rows changed since the previous save), which ``tensorfleet serve-model`` applies as it lands.

With ``--serving_url``, each worker also asks the serving process for its batch's predictions
before training on it, so the run reports the RMSE of what was *served* as well as of what the
trainer knew, and the chief measures freshness: the time from a step's update on the ps to the
serving process answering with it.  ``--delta_every 0`` keeps serving on the deployed model:
the difference in served RMSE is the gain of freshness (``benchmarks/online_serving.py``).

    tensorfleet data fetch movielens
    tensorfleet serve-model /tmp/ml-online --model examples/movielens_online.py --port 8500 &
    tensorfleet launch --ps 1 --workers 2 examples/movielens_online.py -- \\
        --checkpoint_dir /tmp/ml-online --serving_url http://127.0.0.1:8500

The stream's position is the global step, so training is synchronous (the default): every
worker's share of step ``g`` is fixed, and a restarted worker resumes where the fleet is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import tensorfleet as tfl
from movielens import RatingModel, as_tensors  # the batch example's model, beside this file
from tensorfleet.data import movielens as data_set


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tfl.add_cluster_flags(parser)
    tfl.add_training_flags(parser, default_mode="sync")
    parser.add_argument("--history", type=float, default=0.5, help="the oldest fraction of the ratings, trained "
                                                                   "on before the stream (0 < h < 1)")
    parser.add_argument("--history_epochs", type=float, default=3.0, help="shuffled passes over the history")
    parser.add_argument("--batch_size", type=int, default=256, help="ratings per worker per history step")
    parser.add_argument("--stream_batch", type=int, default=32, help="ratings per worker per stream step")
    parser.add_argument("--max_events", type=int, default=None, help="stop the stream after this many ratings")
    parser.add_argument("--dim", type=int, default=32, help="embedding width")
    parser.add_argument("--table_learning_rate", type=float, default=0.08, help="Adagrad, per row")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="Adam, the dense tower")
    parser.add_argument("--l2", type=float, default=0.1, help="weight of the user and movie vectors' squared norm")
    parser.add_argument("--checkpoint_dir", default=None, help="where the chief saves (serve-model follows it)")
    parser.add_argument("--delta_every", type=int, default=10,
                        help="stream steps between checkpoints (deltas); 0: only the deployed model is saved")
    parser.add_argument("--full_every", type=int, default=100, help="a full checkpoint every N saves, deltas between")
    parser.add_argument("--serving_url", default=None, help="ask this serve-model for each batch's predictions too")
    parser.add_argument("--serving_wait", type=float, default=120.0,
                        help="seconds to wait for serving to load the deployed model before the stream starts")
    parser.add_argument("--report", default=None, help="write the chief's figures to this JSON file")
    parser.add_argument("--data_cache", default=None, help="where 'tensorfleet data fetch movielens' put the wheel")
    parser.add_argument("--log_every", type=int, default=200)
    parser.add_argument("--intra_op_threads", type=int, default=1)
    args = parser.parse_args(argv)
    if not 0 < args.history < 1:
        parser.error(f"--history {args.history}: a fraction between 0 and 1")
    if args.mode != "sync":
        parser.error("the stream's position is the global step: run it with --sync")
    if args.serving_url and not args.checkpoint_dir:
        parser.error("--serving_url needs --checkpoint_dir: serving follows the checkpoints")
    return args


def time_order(data: data_set.MovieLens, history: float) -> tuple[np.ndarray, np.ndarray]:
    """(the history's rows, the stream's rows), both by timestamp (ties in the file's order)."""
    order = np.argsort(data.timestamp, kind="stable")
    cut = int(history * len(order))
    return order[:cut], order[cut:]


def build_model(args: argparse.Namespace, data: data_set.MovieLens) -> RatingModel:
    history, _ = time_order(data, args.history)
    torch.manual_seed(0)
    return RatingModel(args.dim, args.table_learning_rate, float(data.rating[history].mean()))


# --- serving: what tensorfleet serve-model calls ----------------------------------------------------

_SERVED_DATA: data_set.MovieLens | None = None


def serving_model(argv: list[str]) -> torch.nn.Module:
    """The model as served: the same class and flags as training (serve-model passes what follows '--')."""
    global _SERVED_DATA
    args = parse_args(argv)
    _SERVED_DATA = data_set.load(args.data_cache)
    return build_model(args, _SERVED_DATA)


def predict(module: torch.nn.Module, inputs: dict) -> dict:
    """``{"user": [ids], "item": [ids]}`` -> ``{"rating": [predicted 1..5]}``."""
    assert _SERVED_DATA is not None, "serving_model() first"
    user, item = np.asarray(inputs["user"], dtype=np.int64), np.asarray(inputs["item"], dtype=np.int64)
    if user.ndim != 1 or user.shape != item.shape:
        raise ValueError(f"user and item must be lists of the same length, got {user.shape} and {item.shape}")
    predicted, _ = module(as_tensors(_SERVED_DATA.features(user, item)))
    return {"rating": predicted.clamp(1, 5)}


class ServingClient:
    """The serving process, asked for a batch's predictions; None when it cannot answer (counted)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.missed = 0

    def model(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/model", timeout=5) as reply:
                return json.loads(reply.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_for_step(self, step: int, timeout: float) -> bool:
        """Wait until serving answers with global step ``step`` or later."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            served = self.model()
            if served and served.get("version") and served["version"]["global_step"] >= step:
                return True
            time.sleep(0.05)
        return False

    def predict(self, user: np.ndarray, item: np.ndarray) -> tuple[np.ndarray, int] | None:
        body = json.dumps({"inputs": {"user": user.tolist(), "item": item.tolist()}}).encode()
        request = urllib.request.Request(f"{self.url}/v1/predict", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                answer = json.loads(reply.read())
        except (urllib.error.URLError, OSError, ValueError):
            self.missed += 1
            return None
        return np.asarray(answer["outputs"]["rating"], dtype=np.float32), answer["model"]["global_step"]


class Prequential:
    """Squared errors of predictions made before training: the running RMSE."""

    def __init__(self) -> None:
        self.squared, self.count = 0.0, 0

    def add(self, predicted: np.ndarray, actual: np.ndarray) -> None:
        self.squared += float(((np.clip(predicted, 1, 5) - actual) ** 2).sum())
        self.count += len(actual)

    @property
    def rmse(self) -> float:
        return (self.squared / self.count) ** 0.5 if self.count else float("nan")


def freshness(step_times: dict[int, float], reloads: list[dict]) -> dict:
    """How long each step's update took to reach serving: from the step's apply on the ps (``step_times``) to
    the first reload that carries it (the first whose global step is at least it)."""
    reloads = sorted(reloads, key=lambda r: r["applied_at"])
    latencies = []
    for step, applied in sorted(step_times.items()):
        served = next((r["applied_at"] for r in reloads if r["global_step"] >= step), None)
        if served is not None:
            latencies.append(served - applied)
    if not latencies:
        return {"steps": 0}
    values = np.array(latencies)
    figures = {"mean_s": values.mean(), "p50_s": np.percentile(values, 50), "p95_s": np.percentile(values, 95),
               "max_s": values.max()}
    # Milliseconds: the clocks of the ps and of serving are read apart, finer is noise.
    return {"steps": len(values), **{name: round(float(value), 3) for name, value in figures.items()}}


def freshness_text(figures: dict) -> str:
    """The console's line of ``freshness``'s figures."""
    if not figures.get("steps"):
        return "freshness: no stream step reached serving"
    return (f"freshness: {figures['steps']} stream steps reached serving {figures['mean_s']:.2f} s after their "
            f"update on average (p50 {figures['p50_s']:.2f} s, p95 {figures['p95_s']:.2f} s, "
            f"max {figures['max_s']:.2f} s)")


def train(args: argparse.Namespace, cluster: tfl.ClusterSpec, task: tfl.TaskSpec) -> None:
    data = data_set.load(args.data_cache)
    history, stream = time_order(data, args.history)
    if args.max_events:
        stream = stream[:args.max_events]
    replica_id, num_workers = cluster.replica_id(task), len(cluster.replicas)
    model = build_model(args, data)
    replica = tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.adam(lr=args.learning_rate),
                          **tfl.training_options(args))
    history_steps = int(args.history_epochs * len(history) / (args.batch_size * num_workers))
    window = args.stream_batch * num_workers
    last_step = history_steps + len(stream) // window
    rng = np.random.default_rng(replica_id)
    saver = tfl.Checkpointer(args.checkpoint_dir, full_every=args.full_every, max_to_keep=20) \
        if args.checkpoint_dir and replica.is_chief else None
    serving = ServingClient(args.serving_url) if args.serving_url else None
    trained, served = Prequential(), Prequential()
    staleness: list[int] = []
    step_times: dict[int, float] = {}
    batch: dict = {}

    def loss() -> torch.Tensor:
        features, ratings = batch["features"], batch["ratings"]
        predicted, norms = model(features)
        if batch["stream"]:  # predicted with the ps's rows as they are now: before training on them
            trained.add(predicted.detach().numpy(), ratings.numpy())
        return F.mse_loss(predicted, ratings) + args.l2 * norms

    with tfl.TrainingSession(replica, hooks=[tfl.StopAtStepHook(last_step=last_step)],
                             log_step_count_steps=args.log_every) as session:
        while not session.should_stop():
            step = session.global_step
            if step < history_steps:
                rows = rng.choice(history, args.batch_size, replace=False)
            else:
                if step == history_steps:
                    if saver:
                        saver.save(replica)  # the deployed model
                    if serving and not serving.wait_for_step(history_steps, args.serving_wait):
                        print(f"worker {replica_id}: serving at {serving.url} did not load step {history_steps} "
                              f"within {args.serving_wait:.0f} s; going on", flush=True)
                start = (step - history_steps) * window + replica_id * args.stream_batch
                rows = stream[start:start + args.stream_batch]
                if serving is not None:
                    answer = serving.predict(data.user[rows], data.item[rows])
                    if answer is not None:
                        served.add(answer[0], data.rating[rows])
                        staleness.append(step - answer[1])
            batch.update(features=as_tensors(data.rating_features(rows)), ratings=torch.from_numpy(data.rating[rows]),
                         stream=step >= history_steps)
            result = session.run_step(loss, batch_size=len(rows))
            if step >= history_steps:
                step_times[result.global_step] = time.time()
                if saver and args.delta_every and (result.global_step - history_steps) % args.delta_every == 0:
                    saver.save(replica)
        if saver and args.delta_every and session.global_step > history_steps:
            saver.save(replica)  # the last steps too, so every update reaches serving
    report = {"worker": replica_id, "stream_ratings": trained.count, "prequential_rmse": trained.rmse,
              "history_steps": history_steps, "last_step": last_step, "delta_every": args.delta_every}
    print(f"worker {replica_id}: prequential RMSE {trained.rmse:.4f} over {trained.count} stream ratings "
          f"(each predicted before it was trained on)")
    if serving is not None:
        report.update(served_ratings=served.count, served_rmse=served.rmse, serving_missed=serving.missed,
                      mean_staleness_steps=float(np.mean(staleness)) if staleness else None)
        behind = report["mean_staleness_steps"]
        print(f"worker {replica_id}: served RMSE {served.rmse:.4f} over {served.count} ratings "
              f"({serving.missed} unanswered), serving {'?' if behind is None else f'{behind:.1f}'} steps behind "
              "on average")
        if replica.is_chief:
            serving.wait_for_step(session.global_step if args.delta_every else history_steps, 30)
            reloads = (serving.model() or {}).get("reloads", [])
            report["freshness"] = freshness(step_times, reloads) if args.delta_every else None
            if report["freshness"]:
                print(freshness_text(report["freshness"]))
    if args.report and replica.is_chief:
        Path(args.report).write_text(json.dumps(report, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return tfl.run_task(args, train, intra_op_threads=args.intra_op_threads)


if __name__ == "__main__":
    sys.exit(main())
