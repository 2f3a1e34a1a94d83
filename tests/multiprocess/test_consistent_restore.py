"""Checkpoints of a running fleet of processes are consistent cuts, and a ps killed mid-run and restored from one
leaves the shards agreeing exactly (issue 30, item 3): two scalars on two ps, each push lowers both by 1, two async
workers, a checkpoint every 20 steps. Before the restore was fenced, one run in a dozen found a checkpoint torn by
one push just after it (Init(force) reached the shards one by one while the other worker kept pushing)."""

import re
from pathlib import Path

import pytest
import torch

from tensorfleet.testing.fleet import Fleet, poll
from tensorfleet.train.checkpoint import latest_checkpoint, load, load_file
from tensorfleet.train.manifest import list_checkpoints

pytestmark = pytest.mark.cluster
JOB = Path(__file__).with_name("two_scalars_job.py")
LAST_STEP = 2000  # a checkpoint every 20 steps: 100 of them, each checked to be a cut


def exact(checkpoint) -> tuple[float, float, list[int]]:
    values = checkpoint.state.values
    return float(values["a"]), float(values["b"]), checkpoint.info["shard_updates"]


@pytest.mark.parametrize("kill_ps", [False, True], ids=["running", "ps-killed-and-restored"])
def test_every_checkpoint_of_a_running_fleet_is_a_cut(tmp_path, kill_ps):
    ckpt = tmp_path / "ckpt"
    fleet = Fleet(tmp_path / "logs", JOB, ["--checkpoint_dir", str(ckpt), "--last_step", str(LAST_STEP)],
                  num_ps=2, num_workers=2)
    try:
        if kill_ps:
            poll(lambda: (ckpt / "checkpoint.json").exists() and load(latest_checkpoint(ckpt)).global_step >= 800,
                 120, "a checkpoint at step 800")
            fleet.kill("ps:1")
            fleet.start("ps:1")  # empty: the chief fences ps:0 and rolls every shard back to the latest checkpoint
        codes = fleet.wait_all(timeout_s=240)
        assert codes == {"ps:0": 0, "ps:1": 0, "worker:0": 0, "worker:1": 0}, {n: fleet.log(n) for n in codes}
    finally:
        fleet.stop()
    if kill_ps:
        assert re.search(r"every shard restored to global step \d+", fleet.log("worker:0"))
    files = list_checkpoints(ckpt)
    assert len(files) > 50
    torn = []
    for path in files:
        a, b, updates = exact(load_file(path))
        if not (a == b == -updates[0] and updates[0] == updates[1]):
            torn.append((path.name, a, b, updates))
    assert not torn, f"{len(torn)} of {len(files)} checkpoints are not one cut, e.g. {torn[:3]}"
    last = load(latest_checkpoint(ckpt))  # saved at the end
    a, b, updates = exact(last)
    assert a == b == -updates[0] and last.global_step >= LAST_STEP
    assert torch.equal(last.state.values["a"], last.state.values["b"])
