"""Checkpoints against real ps servers: every shard's state, restorable into a different number of ps."""

import copy
import json

import pytest
import torch
from torch import nn

from tensorfleet.cluster.placement import GreedyByBytes, RowPartitioner
from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import DataError, InvalidArgumentError
from tensorfleet.cli import main as cli
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.testing.models import seeded_mlp
from tensorfleet.train.checkpoint import Checkpointer, list_checkpoints, load, load_into_module
from tensorfleet.worker.replica import Replica

SPEC = OptimizerSpec.adam(lr=0.01)


INITIAL = seeded_mlp(6, 9, 4, activation=nn.ReLU)


def train(replica: Replica, model: nn.Module, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(5, 6, generator=generator), torch.randint(0, 4, (5,), generator=generator)
        replica.pull()
        nn.functional.cross_entropy(model(x), y).backward()
        replica.push()
    replica.pull()


def run(num_ps: int, steps: range, *, saver: Checkpointer | None = None, save: bool = False, **placement):
    """Train one worker on a fresh cluster of ``num_ps`` ps; return (parameters, averages, global step)."""
    with ps_servers(num_ps=num_ps, num_workers=1) as (cluster, _):
        model = copy.deepcopy(INITIAL)
        replica = Replica(model, cluster, TaskSpec("worker", 0), optimizer=SPEC, average_decay=0.9, **placement)
        (saver.start(replica) if saver else replica.start())
        train(replica, model, steps)
        if save:
            saver.save(replica)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        replica.load_averages()
        averages = {n: p.detach().clone() for n, p in model.named_parameters()}
        step = replica.global_step
        replica.client.close()
    return params, averages, step


def test_checkpoint_from_2_ps_restores_into_3_partitioned_ps_and_training_continues_exactly(tmp_path):
    expected_params, expected_averages, expected_step = run(2, range(10))
    saver = Checkpointer(tmp_path, max_to_keep=3)
    run(2, range(5), saver=saver, save=True)
    params, averages, step = run(3, range(5, 10), saver=saver, placement=GreedyByBytes(),
                                 partitioner=RowPartitioner(num_parts=2))
    assert step == expected_step == 10
    for name in expected_params:  # Adam's moments and step counts came back too, or this would differ
        torch.testing.assert_close(params[name], expected_params[name], rtol=0, atol=1e-6)
        torch.testing.assert_close(averages[name], expected_averages[name], rtol=0, atol=1e-6)


def test_restarted_chief_does_not_roll_a_running_ps_back(tmp_path):
    saver = Checkpointer(tmp_path)
    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        model = copy.deepcopy(INITIAL)
        replica = saver.start(Replica(model, cluster, TaskSpec("worker", 0), optimizer=SPEC))
        train(replica, model, range(3))
        saver.save(replica)  # at step 3
        train(replica, model, range(3, 6))
        trained = {**servers[0].store.read()[0], **servers[1].store.read()[0]}
        replica.client.close()
        again = saver.start(Replica(copy.deepcopy(INITIAL), cluster, TaskSpec("worker", 0), optimizer=SPEC))
        assert again.global_step == 6  # the ps kept step 6; the step-3 checkpoint was not forced on it
        now = {**servers[0].store.read()[0], **servers[1].store.read()[0]}
        assert all(torch.equal(trained[n], now[n]) for n in trained)
        again.client.close()


def test_max_to_keep_manifest_atomicity_cli_and_inference_load(tmp_path, capsys):
    saver = Checkpointer(tmp_path, max_to_keep=2)
    with ps_servers(num_ps=2, num_workers=1) as (cluster, _):
        model = copy.deepcopy(INITIAL)
        replica = saver.start(Replica(model, cluster, TaskSpec("worker", 0), optimizer=SPEC,
                                      partitioner=RowPartitioner(num_parts=2)))
        for k in range(3):
            train(replica, model, range(k, k + 1))
            saver.save(replica)
        final = {n: p.detach().clone() for n, p in model.named_parameters()}
        replica.client.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["model.ckpt-2.safetensors", "model.ckpt-3.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json", "model.ckpt-2.safetensors",
                                                          "model.ckpt-3.safetensors"]  # no temp files left
    checkpoint = load(tmp_path)
    assert checkpoint.global_step == 3 and checkpoint.info["num_ps"] == 2
    assert set(checkpoint.state.slots["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    # A plain module, no cluster: the partitioned variables come back whole.
    plain = copy.deepcopy(INITIAL)
    assert load_into_module(plain, tmp_path) == 3
    assert all(torch.equal(p.detach(), final[n]) for n, p in plain.named_parameters())
    with pytest.raises(InvalidArgumentError, match="does not match the module"):
        load_into_module(nn.Linear(6, 4), tmp_path)
    # The command line lists and shows them.
    assert cli(["ckpt", "ls", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "model.ckpt-2" in listing and "model.ckpt-3" in listing and "latest" in listing
    assert cli(["ckpt", "show", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "global step: 3" in shown and "0.weight" in shown and "(9, 6)" in shown and "adam" in shown


def test_damaged_checkpoints_are_reported(tmp_path, capsys):
    (tmp_path / "checkpoint.json").write_text("{not json")
    with pytest.raises(DataError, match="manifest is damaged"):
        load(tmp_path)
    (tmp_path / "checkpoint.json").write_text(json.dumps({"latest": "model.ckpt-1.safetensors", "all": []}))
    with pytest.raises(DataError, match="does not exist"):
        load(tmp_path)
    (tmp_path / "model.ckpt-1.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(DataError, match="not a readable checkpoint"):
        load(tmp_path)
    assert cli(["ckpt", "show", str(tmp_path)]) == 1
    assert "not a readable checkpoint" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no checkpoint"):
        load(tmp_path / "empty")
