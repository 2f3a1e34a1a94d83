"""The gain of freshness: the online MovieLens replay served with deltas every N steps, against never (issue 20).

    python benchmarks/online_serving.py                    # deltas every 10 and 50 stream steps, and never
    python benchmarks/online_serving.py --delta_every 10 --workers 2 --json online.json

Each run starts ``tensorfleet serve-model`` on a fresh checkpoint directory, then ``tensorfleet launch``
of ``examples/movielens_online.py`` beside it (1 ps, ``--workers`` workers, sync): half the ratings by
time are the history (3 shuffled passes), the other half a stream of windows of 32 ratings per worker,
each predicted by the trainer and by the serving process before it is trained on.  With deltas, the
chief saves one every N stream steps and serving applies it as it lands; with ``--delta_every 0``
serving keeps the model deployed at the end of the history.  Printed per run: the trainer's and the
served prequential RMSE (over the chief's share of the stream), how many steps serving was behind,
and freshness (seconds from a step's update on the ps to serving answering with it: mean, p50, p95);
then each run's served RMSE against never's (the ratio: below 1 is the gain).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tensorfleet.testing.local_cluster import REPO, run_launcher
from tensorfleet.testing.serving import serve_model

SCRIPT = REPO / "examples" / "movielens_online.py"


def run(delta_every: int, workers: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="tensorfleet-online-") as tmp:
        checkpoints, report = Path(tmp) / "ckpt", Path(tmp) / "report.json"
        with serve_model(checkpoints, SCRIPT, ["--poll-interval", "0.05"], extra) as (_, url):
            job = run_launcher(SCRIPT, [*extra, "--checkpoint_dir", str(checkpoints), "--serving_url", url,
                                        "--delta_every", str(delta_every), "--report", str(report)],
                               num_ps=1, num_workers=workers, timeout_s=1800)
        if job.returncode != 0:
            sys.exit(f"the job with --delta_every {delta_every} failed:\n{job.output[-3000:]}")
        return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delta_every", type=int, nargs="+", default=[10, 50],
                        help="stream steps between deltas, one run each (never: always run too)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("script_args", nargs="*", help="more flags for the example, after '--'")
    args = parser.parse_args()
    results = {every: run(every, args.workers, args.script_args) for every in [*args.delta_every, 0]}
    never = results[0]["served_rmse"]
    print(f"{'deltas every':>14} {'trainer RMSE':>13} {'served RMSE':>12} {'vs never':>9} {'steps behind':>13} "
          f"{'fresh mean s':>13} {'p50 s':>7} {'p95 s':>7}")
    for every, figures in results.items():
        fresh = figures.get("freshness") or {}
        print(f"{str(every) + ' steps' if every else 'never':>14} {figures['prequential_rmse']:>13.4f} "
              f"{figures['served_rmse']:>12.4f} {figures['served_rmse'] / never:>9.3f} "
              f"{figures['mean_staleness_steps']:>13.1f} {fresh.get('mean_s', float('nan')):>13.3f} "
              f"{fresh.get('p50_s', float('nan')):>7.3f} {fresh.get('p95_s', float('nan')):>7.3f}")
    print(f"({results[0]['served_ratings']} ratings of the stream served to the chief per run; steps behind: "
          "global steps between the ps and the version that answered)")
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
