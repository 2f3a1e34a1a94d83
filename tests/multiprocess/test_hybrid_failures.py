"""Hybrid mode's failures with real processes (issue 40): a worker killed with SIGKILL mid-training.

The ps runs as ``python -m tensorfleet.ps``, the workers run hybrid_job.py (dense by gloo, a table on the ps,
async tables); every wait polls with a deadline.
"""

import re
from pathlib import Path

import pytest
import torch

from tensorfleet.testing.fleet import Fleet, poll

pytestmark = pytest.mark.cluster
JOB = Path(__file__).with_name("hybrid_job.py")


@pytest.fixture
def fleet_factory(tmp_path):
    fleets = []

    def make(*extra):
        fleets.append(Fleet(tmp_path / "logs", JOB, ["--out", str(tmp_path), *extra]))
        return fleets[-1]

    yield make
    for fleet in fleets:
        fleet.stop()


def test_the_survivors_go_on_among_the_living_and_a_restarted_worker_joins_them(fleet_factory, tmp_path):
    """Async (Persia's mode): worker 1 SIGKILLed, the survivor re-forms the group alone and trains on without
    the ps restarting; the restarted worker waits until the group lets it in at a step boundary, takes the
    survivor's live dense state, and the job ends with both replicas equal."""
    fleet = fleet_factory()
    poll(lambda: fleet.ps_status().global_step >= 200, 90, "global step 200")
    fleet.kill("worker:1")
    at_kill = fleet.ps_status().global_step
    poll(lambda: "replicated on 1 of 2 workers" in fleet.log("worker:0"), 60, "the survivor to re-form alone")
    poll(lambda: fleet.ps_status().global_step >= at_kill + 100, 60, "the survivor to train on alone")
    fleet.start("worker:1")  # the ps is not restarted
    codes = fleet.wait_all()
    assert codes == {"ps:0": 0, "worker:0": 0, "worker:1": 0}, {n: fleet.log(n) for n in codes}
    survivor, restarted = fleet.log("worker:0"), fleet.log("worker:1")
    joined = re.search(r"replicated on 2 of 2 workers \(generation (\d+), replicas \[0, 1\], state from worker 0\)",
                       restarted)
    assert joined and int(joined.group(1)) >= 2, restarted  # the survivor's live state, in a later group
    # the survivor's rows of the failed step reached the ps; only its dense update is dropped (no step runs twice)
    assert "a worker of the group is gone" in survivor and "this step's dense update is dropped" in survivor
    values = [torch.load(tmp_path / f"worker-{i}.pt") for i in range(2)]
    assert all(torch.equal(values[0][name], values[1][name]) for name in values[0])  # the replicas agree


def test_in_sync_mode_a_worker_that_never_comes_back_ends_the_survivor_in_bounded_time_saying_why(fleet_factory):
    """Sync: the ps aggregates every worker's rows, so the group waits for all of them, up to its timeouts."""
    fleet = fleet_factory("--mode", "sync", "--init_timeout_s", "5", "--sync_timeout_s", "5")
    poll(lambda: fleet.ps_status().global_step >= 50, 90, "global step 50")
    fleet.kill("worker:1")
    survivor = fleet.procs["worker:0"]
    poll(lambda: survivor.poll() is not None, 60, "the survivor to give up")
    assert survivor.returncode != 0
    assert "the workers' collective did not form within 5 s (at the job's start and in sync mode all 2 workers " \
           "must join it; missing: /job:worker/task:1)" in fleet.log("worker:0")
