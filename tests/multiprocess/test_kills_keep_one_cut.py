"""Kills at chosen moments keep the fleet at one point in time, and a coordinated job always ends (issue 42): two
scalars on two ps, each push lowers both by 1, so a checkpoint, or the fleet after a restore, holds a == b ==
-(the updates each shard applied) unless a push landed on one shard only.

Before: a chief killed together with a ps restored the empty ps only (the live one refused the unforced Init):
a - b = 84 for the rest of the job. A worker killed once the coordinator's closures were done, restarted after
its shutdown, waited for a Done forever, and the ps with it. In synchronous training a worker killed mid-closure
ran the closure again behind its partner, and the job's end waited out the 300 s sync timeout."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tensorfleet.testing.fleet import Fleet, poll
from tensorfleet.testing.local_cluster import REPO, LauncherProcess
from tensorfleet.train.checkpoint import latest_checkpoint, load, load_file
from tensorfleet.train.manifest import list_checkpoints

pytestmark = pytest.mark.cluster
JOB = Path(__file__).with_name("two_scalars_job.py")
COORDINATED = Path(__file__).with_name("two_scalars_coordinated.py")


def torn_checkpoints(ckpt: Path) -> tuple[list, int]:
    """The checkpoints that are not one cut (a != b, or the shards' update counts apart), and how many there are."""
    files = list_checkpoints(ckpt)
    torn = []
    for path in files:
        checkpoint = load_file(path)
        a, b = float(checkpoint.state.values["a"]), float(checkpoint.state.values["b"])
        updates = checkpoint.info["shard_updates"]
        if not (a == b == -updates[0] and updates[0] == updates[1]):
            torn.append((path.name, a, b, updates))
    return torn, len(files)


def latest_step(ckpt: Path) -> int:
    latest = latest_checkpoint(ckpt) if (ckpt / "checkpoint.json").exists() else None
    return load(latest).global_step if latest is not None else -1


def test_the_chief_killed_together_with_a_ps_restores_every_shard(tmp_path):
    ckpt = tmp_path / "ckpt"
    fleet = Fleet(tmp_path / "logs", JOB, ["--checkpoint_dir", str(ckpt), "--last_step", "1500"],
                  num_ps=2, num_workers=2)
    try:
        poll(lambda: latest_step(ckpt) >= 500, 180, "a checkpoint at step 500")
        fleet.kill("worker:0")  # the chief ...
        fleet.kill("ps:1")  # ... and a ps, together
        fleet.start("ps:1")
        fleet.start("worker:0")
        codes = fleet.wait_all(timeout_s=240)
        assert codes == {"ps:0": 0, "ps:1": 0, "worker:0": 0, "worker:1": 0}, {n: fleet.log(n) for n in codes}
    finally:
        fleet.stop()
    restarted = fleet.log("worker:0")
    assert "ps task(s) [1] are empty while ps task(s) [0] hold trained variables" in restarted, restarted
    assert re.search(r"every shard restored to global step \d+", restarted), restarted
    torn, count = torn_checkpoints(ckpt)
    assert count > 50 and not torn, f"{len(torn)} of {count} checkpoints are not one cut, e.g. {torn[:3]}"
    last = load(latest_checkpoint(ckpt))  # saved at the end: the fleet agrees
    assert float(last.state.values["a"]) == float(last.state.values["b"]) and last.global_step >= 1500


def test_a_ps_killed_again_and_again_while_the_chief_saves_every_other_step(tmp_path):
    """Saves every 2 steps, so that kills often land in one (a failed save, its other shard fenced)."""
    ckpt = tmp_path / "ckpt"
    fleet = Fleet(tmp_path / "logs", JOB, ["--checkpoint_dir", str(ckpt), "--last_step", "1500", "--save_steps", "2"],
                  num_ps=2, num_workers=2)
    try:
        for at in (300, 700, 1100):
            poll(lambda: latest_step(ckpt) >= at, 180, f"a checkpoint at step {at}")
            fleet.kill("ps:1")
            fleet.start("ps:1")
        codes = fleet.wait_all(timeout_s=240)
        assert codes == {"ps:0": 0, "ps:1": 0, "worker:0": 0, "worker:1": 0}, {n: fleet.log(n) for n in codes}
    finally:
        fleet.stop()
    torn, count = torn_checkpoints(ckpt)
    assert count > 100 and not torn, f"{len(torn)} of {count} checkpoints are not one cut, e.g. {torn[:3]}"
    last = load(latest_checkpoint(ckpt))
    assert float(last.state.values["a"]) == float(last.state.values["b"]) and last.global_step >= 1500


def coordinated(tmp_path: Path, *script_args: str) -> LauncherProcess:
    return LauncherProcess(tmp_path / "job", ["--coordinator", "--ps", "2", "--workers", "2", "--max-restarts", "2"],
                           COORDINATED, ["--checkpoint_dir", str(tmp_path / "ckpt"), *script_args])


def test_a_worker_restarted_after_the_coordinator_shut_down_ends_and_so_does_the_job(tmp_path):
    hold = tmp_path / "killed"
    run = coordinated(tmp_path, "--last_step", "300", "--hold_after_join", str(hold))
    try:
        poll(lambda: "driver: joined" in run.output, 180, "every closure to have run")
        os.kill(run.events_of("worker:1", "started")[0]["pid"], signal.SIGKILL)  # before the coordinator's Done
        hold.touch()  # the coordinator shuts down now: its Done finds worker:1 dead
        code, output = run.wait(timeout_s=120)  # before: the restarted worker:1 and the ps waited forever
    finally:
        run.kill()
    assert code == 0, output
    assert len(run.events_of("worker:1", "started")) == 2, output
    assert "the coordinator has finished the job" in (tmp_path / "job" / "worker-1.log").read_text()


def test_sync_a_worker_killed_mid_closure_does_not_stall_the_end(tmp_path):
    paused = tmp_path / "paused"
    run = coordinated(tmp_path, "--sync", "--last_step", "800", "--pause_marker", str(paused), "--pause_at_step", "200")
    try:
        poll(paused.exists, 180, "worker:1 half-way through a closure after step 200")
        os.kill(run.events_of("worker:1", "started")[0]["pid"], signal.SIGKILL)  # 10 steps pushed of the closure's 20
        killed = time.monotonic()
        code, output = run.wait(timeout_s=240)
        took = time.monotonic() - killed
    finally:
        run.kill()
    assert code == 0, output
    assert took < 150, f"the job ended {took:.0f} s after the kill: the sync timeout (300 s) was waited out"
    assert re.search(r"the 10 step\(s\) aggregated since are skipped", (tmp_path / "job" / "worker-1.log").read_text())
    torn, count = torn_checkpoints(tmp_path / "ckpt")
    assert count > 10 and not torn, f"{len(torn)} of {count} checkpoints are not one cut, e.g. {torn[:3]}"
