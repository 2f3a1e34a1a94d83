"""The short chaos run: the MNIST job under the supervised launcher survives a worker, chief and ps SIGKILL.

``benchmarks/chaos.py`` does the killing and the checking (job done, accuracy, nothing left behind,
global step only back to a checkpoint after a ps loss, every accepted push applied exactly once);
the full run (12 kills) is in benchmarks/README.md.
"""

import json
import subprocess
import sys

import pytest

from tensorfleet.testing.local_cluster import REPO

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(400)
def test_three_kills_of_worker_chief_and_ps_leave_a_finished_accurate_job(tmp_path):
    out = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "chaos.py"), "--kills", "3", "--seed", "0",
                           "--train_steps", "4000", "--save_steps", "250", "--min_accuracy", "0.95",
                           "--workdir", str(tmp_path / "work"), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=380)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"], result["failures"]
    assert sorted(k["victim"] for k in result["kills"]) == ["ps:0", "worker:0", "worker:1"]
    assert result["exit_code"] == 0 and result["test_accuracy"] >= 0.95
    final = result["final_ps"]
    assert final["applied_updates"] == final["initial_updates"] + final["accepted_pushes"]
    assert done.returncode == 0
