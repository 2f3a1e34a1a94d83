"""The online MovieLens replay under ``tensorfleet launch`` with ``tensorfleet serve-model`` beside it: the stream
is predicted before it is trained on, every batch is also answered by the serving process, and the deltas the
chief saves reach serving while it answers (the issue's "done when")."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tensorfleet.testing.local_cluster import REPO, run_launcher
from tensorfleet.testing.serving import serve_model

pytestmark = pytest.mark.cluster
SCRIPT = REPO / "examples" / "movielens_online.py"
SHORT = ["--history", "0.05", "--history_epochs", "1", "--max_events", "1920", "--delta_every", "3"]


def test_an_online_replay_trains_in_time_order_and_serving_follows_its_deltas(tmp_path):
    fetched = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "data", "fetch", "movielens"],
                             capture_output=True, text=True, timeout=600)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    checkpoints, report = tmp_path / "ckpt", tmp_path / "report.json"
    with serve_model(checkpoints, SCRIPT, ["--poll-interval", "0.05"], SHORT) as (server, url):
        job = run_launcher(SCRIPT, [*SHORT, "--checkpoint_dir", str(checkpoints), "--serving_url", url,
                                    "--report", str(report)], num_ps=1, num_workers=2, timeout_s=300)
        assert job.returncode == 0, job.output
    figures = json.loads(report.read_text())
    # 1920 ratings in windows of 2 x 32: 30 stream steps, each rating predicted by the trainer and by serving
    assert figures["stream_ratings"] == 960 and figures["served_ratings"] == 960, figures
    assert figures["serving_missed"] == 0 and figures["last_step"] == figures["history_steps"] + 30
    assert figures["prequential_rmse"] < 1.3 and figures["served_rmse"] < 1.4, figures
    # every stream step reached serving: the reloads carried deltas up to the last step
    assert figures["freshness"]["steps"] == 30 and 0 <= figures["freshness"]["mean_s"] < 30, figures
    assert sum("applied)" in line for line in server.output) >= 5, "".join(server.output)
    assert "prequential RMSE" in job.output and "served RMSE" in job.output
    assert re.search(r"serving \d+\.\d steps behind on average", job.output), job.output  # one decimal, not 15
    assert re.search(r"freshness: 30 stream steps reached serving \d+\.\d\d s after their update", job.output), \
        job.output  # issue 44: seconds to the hundredth, not 15 decimals
