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


def test_a_killed_worker_restarted_takes_the_survivors_dense_state_and_the_job_ends_with_equal_replicas(
        fleet_factory, tmp_path):
    fleet = fleet_factory()
    poll(lambda: fleet.ps_status().global_step >= 200, 90, "global step 200")
    fleet.kill("worker:1")
    at_kill = fleet.ps_status().global_step
    fleet.start("worker:1")  # the ps is not restarted
    codes = fleet.wait_all()
    assert codes == {"ps:0": 0, "worker:0": 0, "worker:1": 0}, {n: fleet.log(n) for n in codes}
    survivor, restarted = fleet.log("worker:0"), fleet.log("worker:1")
    formed = re.search(r"generation (\d+), state from worker (\d+)", restarted)
    assert formed and int(formed.group(1)) >= 1 and formed.group(2) == "0", restarted  # the survivor's live state
    assert re.search(r"recoveries [1-9]", survivor) and "a worker of the group is gone" in survivor
    started = re.search(r"worker 1 starts at global step (\d+)", restarted)
    assert started and int(started.group(1)) >= at_kill
    values = [torch.load(tmp_path / f"worker-{i}.pt") for i in range(2)]
    assert all(torch.equal(values[0][name], values[1][name]) for name in values[0])  # the replicas agree


def test_a_worker_that_never_comes_back_ends_the_survivor_in_bounded_time_saying_what_it_waited_for(fleet_factory):
    fleet = fleet_factory("--init_timeout_s", "5")
    poll(lambda: fleet.ps_status().global_step >= 100, 90, "global step 100")
    fleet.kill("worker:1")
    survivor = fleet.procs["worker:0"]
    poll(lambda: survivor.poll() is not None, 60, "the survivor to give up")
    assert survivor.returncode != 0
    assert "the workers' collective did not form within 5 s (all 2 workers must join it)" in fleet.log("worker:0")
