"""5-fold cross-validated RMSE of examples/movielens.py on MovieLens-100K, each fold one ``tensorfleet launch``.

Prints each fold's test RMSE (the chief's), their mean, and the wall time, beside Surprise's published
figures for the same protocol (5-fold, ml-100k): SVD 0.934, SVD++ 0.919, KNNBaseline 0.931,
BaselineOnly 0.944.  Run ``tensorfleet data fetch movielens`` once first.

    python benchmarks/movielens_cv.py                        # 2 ps + 2 workers, sync (the example's default)
    python benchmarks/movielens_cv.py --async --folds 0 1    # some folds, async
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SURPRISE = {"SVD": 0.934, "SVD++": 0.919, "KNNBaseline": 0.931, "BaselineOnly": 0.944}
TARGET = 0.92
RESULT = re.compile(r"fold (\d) test RMSE: ([0-9.]+)")


def run_fold(fold: int, *, ps: int, workers: int, mode: str, script_args: list[str]) -> tuple[float, float]:
    """(the chief's test RMSE, wall seconds) of one fold's launch."""
    command = [sys.executable, "-m", "tensorfleet.cli", "launch", "--ps", str(ps), "--workers", str(workers),
               f"--{mode}", str(REPO / "examples" / "movielens.py"), "--", "--fold", str(fold),
               *script_args]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    chief = [line for line in done.stdout.splitlines() if line.startswith("[worker:0]") and RESULT.search(line)]
    if done.returncode != 0 or not chief:
        sys.exit(f"fold {fold} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    return float(RESULT.search(chief[-1]).group(2)), wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--folds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sync", dest="mode", action="store_const", const="sync", default="sync")
    mode.add_argument("--async", dest="mode", action="store_const", const="async")
    parser.add_argument("script_args", nargs="*", help="after --: flags for examples/movielens.py")
    args = parser.parse_args(argv)
    results = []
    for fold in args.folds:
        rmse, wall = run_fold(fold, ps=args.ps, workers=args.workers, mode=args.mode, script_args=args.script_args)
        results.append((rmse, wall))
        print(f"fold {fold}: test RMSE {rmse:.4f}  ({wall:.0f} s)", flush=True)
    mean = statistics.mean(r for r, _ in results)
    print(f"\nmean RMSE over {len(results)} fold(s): {mean:.4f} (target <= {TARGET}: "
          f"{'met' if mean <= TARGET else 'MISSED'}); {args.ps} ps + {args.workers} workers, "
          f"{args.mode}; wall {sum(w for _, w in results):.0f} s in all")
    print("Surprise, 5-fold ml-100k: " + ", ".join(f"{name} {value}" for name, value in SURPRISE.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
