"""Checkpoints of a running fleet of processes are consistent cuts (issue 30, item 3): two scalars on two ps, each
push lowers both by 1, two async workers, a checkpoint every 20 steps.

Not here yet: a ps killed mid-run. One run in a dozen found a checkpoint torn by one push just after the chief's
restore, whose Init(force) reaches the shards one by one while the other worker keeps pushing: the restore itself
is not yet a cut (see the issue's note)."""

from pathlib import Path

import pytest
import torch

from tensorfleet.testing.fleet import Fleet
from tensorfleet.train.checkpoint import latest_checkpoint, load, load_file
from tensorfleet.train.manifest import list_checkpoints

pytestmark = pytest.mark.cluster
JOB = Path(__file__).with_name("two_scalars_job.py")


def exact(checkpoint) -> tuple[float, float, list[int]]:
    values = checkpoint.state.values
    return float(values["a"]), float(values["b"]), checkpoint.info["shard_updates"]


def test_every_checkpoint_of_a_running_fleet_is_a_cut(tmp_path):
    ckpt = tmp_path / "ckpt"
    fleet = Fleet(tmp_path / "logs", JOB, ["--checkpoint_dir", str(ckpt)], num_ps=2, num_workers=2)
    try:
        codes = fleet.wait_all(timeout_s=240)
        assert codes == {"ps:0": 0, "ps:1": 0, "worker:0": 0, "worker:1": 0}, {n: fleet.log(n) for n in codes}
    finally:
        fleet.stop()
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
    assert a == b == -updates[0] and last.global_step >= 4000
    assert torch.equal(last.state.values["a"], last.state.values["b"])
