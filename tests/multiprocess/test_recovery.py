"""Kill tasks with SIGKILL mid-training and start them again: the job recovers and finishes.

Real processes on 127.0.0.1 (ps via ``python -m tensorfleet.ps``, workers running
recovery_job.py), each with its TF_CONFIG; output goes to files; every wait polls
with a deadline.
"""

import re
from pathlib import Path

import pytest

from tensorfleet.testing.fleet import Fleet, poll
from tensorfleet.train.checkpoint import latest_checkpoint, load

pytestmark = pytest.mark.cluster
JOB = Path(__file__).with_name("recovery_job.py")


def checkpoint_step(directory: Path) -> int:
    latest = latest_checkpoint(directory) if (directory / "checkpoint.json").exists() else None
    return load(latest).global_step if latest else -1


@pytest.fixture
def fleet_factory(tmp_path):
    fleets = []

    def make(*extra):
        fleets.append(Fleet(tmp_path, JOB, ["--checkpoint_dir", str(tmp_path / "ckpt"), *extra]))
        return fleets[-1]

    yield make
    for fleet in fleets:
        fleet.stop()


def test_ps_killed_and_restarted_empty_restores_the_checkpoint_and_finishes(fleet_factory, tmp_path):
    fleet = fleet_factory("--last_step", "1500", "--save_steps", "100")
    saved = poll(lambda: checkpoint_step(tmp_path / "ckpt") >= 300 and checkpoint_step(tmp_path / "ckpt"), 90,
                 "a checkpoint at step >= 300")
    fleet.kill("ps:0")
    fleet.start("ps:0")  # empty
    codes = fleet.wait_all()
    assert codes == {"ps:0": 0, "worker:0": 0, "worker:1": 0}, {n: fleet.log(n) for n in codes}
    chief = fleet.log("worker:0")
    restored = re.search(r"every shard restored to global step (\d+)", chief)
    assert restored and saved <= int(restored.group(1)) < 1500
    saved_steps = {int(s) for s in re.findall(r"saved checkpoint \S+model\.ckpt-(\d+)\.safetensors", chief)}
    assert int(restored.group(1)) in saved_steps  # rolled back exactly to a checkpoint the chief wrote
    for name in ("worker:0", "worker:1"):
        finished = re.search(r"finished at global step (\d+), recoveries (\d+), test accuracy ([\d.]+)", fleet.log(name))
        assert finished and int(finished.group(1)) >= 1500 and int(finished.group(2)) >= 1
        assert float(finished.group(3)) > 0.85
    assert re.search(r"recovered in [\d.]+ s", chief)
    assert "all 2 worker(s) done; exiting" in fleet.log("ps:0")  # the restarted ps exits too


def test_non_chief_killed_and_restarted_rejoins_while_the_others_go_on(fleet_factory):
    fleet = fleet_factory()
    poll(lambda: fleet.ps_status().global_step >= 300, 90, "global step 300")
    fleet.kill("worker:1")
    at_kill = fleet.ps_status().global_step
    # async: nobody waits for the dead worker
    poll(lambda: fleet.ps_status().global_step >= at_kill + 300, 60, "the chief to go on alone")
    fleet.start("worker:1")
    codes = fleet.wait_all()
    assert codes == {"ps:0": 0, "worker:0": 0, "worker:1": 0}, {n: fleet.log(n) for n in codes}
    rejoined = re.search(r"worker 1 starts at global step (\d+)", fleet.log("worker:1"))
    assert rejoined and int(rejoined.group(1)) >= at_kill + 300
    assert "finished at global step" in fleet.log("worker:1")


def test_chief_killed_and_restarted_keeps_the_trained_values_and_checkpoints_on(fleet_factory, tmp_path):
    fleet = fleet_factory("--last_step", "2000")
    poll(lambda: checkpoint_step(tmp_path / "ckpt") >= 400, 90, "a checkpoint at step >= 400")
    fleet.kill("worker:0")
    at_kill = fleet.ps_status().global_step
    fleet.start("worker:0")
    codes = fleet.wait_all()
    assert codes == {"ps:0": 0, "worker:0": 0, "worker:1": 0}, {n: fleet.log(n) for n in codes}
    again = fleet.log("worker:0")
    assert "already holds trained variables; not re-initializing" in again
    started = re.search(r"worker 0 starts at global step (\d+)", again)
    assert started and int(started.group(1)) >= at_kill  # it did not roll training back
    assert checkpoint_step(tmp_path / "ckpt") >= 2000  # checkpointing went on to the end
