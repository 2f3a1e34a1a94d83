"""Towers without processes: options, devices, batch slices, placement lines, one-tower no-ops, refusals."""

import argparse
import logging

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.errors import InvalidArgumentError
from tensorfleet.parallel.towers import Towers

CPU = torch.device("cpu")


@pytest.mark.parametrize("kwargs, match", [
    ({"num_towers": 0}, "num_towers=0"), ({"num_towers": 1.5}, "num_towers=1.5"),
    ({"device_type": "tpu"}, "device_type='tpu'"), ({"timeout_s": 0}, "timeout_s=0"),
])
def test_options_are_validated_on_construction(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        tfl.TowerOptions(**kwargs)


def test_devices_one_gpu_per_tower_or_cpu_processes(gpus, caplog):
    assert tfl.TowerOptions(num_towers=3).devices() == [CPU] * 3  # auto, no GPU: CPU towers
    gpus(2)
    assert tfl.TowerOptions(num_towers=2).devices() == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert tfl.TowerOptions(num_towers=2, device_type="cpu").devices() == [CPU, CPU]
    gpus(1)
    with pytest.raises(InvalidArgumentError, match="/device:GPU:1.*has /device:CPU:0, /device:GPU:0"):
        tfl.TowerOptions(num_towers=2, device_type="gpu").devices()
    with caplog.at_level(logging.WARNING):
        assert tfl.TowerOptions(num_towers=2, allow_soft_placement=True).devices() == [CPU, CPU]
    assert "every tower runs on the CPU" in caplog.text


def test_each_tower_takes_its_slice_of_the_global_batch():
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    options = tfl.TowerOptions(num_towers=3)
    slices = [Towers(options, k, [CPU] * 3, "gloo").split(x, y) for k in range(3)]
    assert torch.equal(torch.cat([s[0] for s in slices]), x) and torch.equal(torch.cat([s[1] for s in slices]), y)
    assert torch.equal(slices[1][1], torch.tensor([2, 3]))
    with pytest.raises(InvalidArgumentError, match="a batch of 7 does not split evenly over 3 towers"):
        Towers(options, 0, [CPU] * 3, "gloo").split(torch.zeros(7, 2))


def test_placement_lines_one_per_parameter_and_tower(caplog):
    options = tfl.TowerOptions(num_towers=2, log_device_placement=True, job="worker", task=1)
    with caplog.at_level(logging.INFO, logger="tensorfleet.parallel.towers"):
        Towers(options, 1, [CPU, CPU], "gloo").log_placement(nn.Linear(3, 2))
    assert "tower_1/weight: /job:worker/replica:0/task:1/device:CPU:1" in caplog.text
    assert "tower_1/bias: /job:worker/replica:0/task:1/device:CPU:1" in caplog.text
    assert "processes sharing this machine's CPUs" in caplog.text


def _body(towers, scale):
    model = nn.Linear(2, 1)
    assert towers.wrap(model) is model  # one tower: no DDP, no process group
    model(torch.ones(1, 2)).sum().backward()
    grad = model.weight.grad.clone()
    towers.average_gradients(model)
    towers.broadcast([model.weight])
    towers.barrier()
    assert torch.equal(model.weight.grad, grad)
    return (towers.index, towers.num_towers, towers.backend, scale)


def test_one_tower_runs_in_this_process_and_every_collective_is_a_no_op():
    assert tfl.run_towers(_body, 3, options=tfl.TowerOptions(num_towers=1)) == (0, 1, None, 3)


def test_what_cannot_reach_a_spawned_tower_fails_before_anything_starts():
    with pytest.raises(InvalidArgumentError, match="module-level function"):
        tfl.run_towers(lambda towers: None, options=tfl.TowerOptions(num_towers=2, device_type="cpu"))


def test_flags_give_tower_options(monkeypatch):
    monkeypatch.setenv("TENSORFLEET_TOWERS", "3")
    parser = argparse.ArgumentParser()
    tfl.add_training_flags(parser, towers=True)
    options = tfl.TowerOptions.from_flags(parser.parse_args(["--allow_soft_placement", "--log_device_placement"]),
                                          job="worker", task=2)
    assert (options.num_towers, options.device_type, options.allow_soft_placement, options.log_device_placement,
            options.job, options.task) == (3, "auto", True, True, "worker", 2)
    assert parser.parse_args(["--towers", "2", "--tower_device", "cpu"]).towers == 2


def test_overlap_is_refused_with_several_towers():
    cluster = ClusterSpec.from_dict({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    towers = Towers(tfl.TowerOptions(num_towers=2), 0, [CPU, CPU], "gloo")
    with pytest.raises(InvalidArgumentError, match="before the towers have averaged it"):
        tfl.TowerReplica(towers, nn.Linear(2, 1), cluster, TaskSpec("worker", 0),
                         optimizer=tfl.OptimizerSpec.sgd(lr=0.1), overlap=True)
