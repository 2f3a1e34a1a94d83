"""The flags every training script shares: no abbreviations, no flag that does nothing, options that compose."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.launch.task import run_task
from tensorfleet.testing.local_cluster import REPO


def script_parser(**flags) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    tfl.add_cluster_flags(parser)
    tfl.add_training_flags(parser, **flags)
    return parser


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv", [["--ps", "1"], ["--worker", "a:1"], ["--replicas", "2"], ["--moving", "0.9"]])
def test_a_prefix_of_a_flag_is_an_error_not_that_flag(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        script_parser().parse_args(argv)
    assert caught.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_a_script_without_towers_refuses_the_towers_flag(capsys):
    with pytest.raises(SystemExit) as caught:
        example("mnist_mlp").parse_args(["--towers", "2"])
    assert caught.value.code == 2 and "--towers" in capsys.readouterr().err
    assert script_parser(towers=True).parse_args(["--towers", "2"]).towers == 2


def test_towers_asked_by_the_environment_of_a_script_without_towers_is_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("TENSORFLEET_TOWERS", "2")
    args = script_parser().parse_args(["--ps_hosts", "127.0.0.1:1", "--worker_hosts", "127.0.0.1:2",
                                       "--job_name", "worker", "--task_index", "0"])
    assert run_task(args, lambda *_: pytest.fail("trained without the towers it was asked for")) == 2
    assert "TENSORFLEET_TOWERS=2" in capsys.readouterr().err


def test_options_left_at_their_default_stay_out_so_explicit_arguments_compose():
    assert tfl.training_options(script_parser().parse_args([])) == {}
    cluster = ClusterSpec.from_dict({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    replica = tfl.Replica(nn.Linear(2, 1), cluster, TaskSpec("worker", 0), optimizer=tfl.OptimizerSpec.sgd(lr=0.1),
                          average_decay=0.99, **tfl.training_options(script_parser().parse_args(["--sync"])))
    assert (replica.average_decay, replica.mode) == (0.99, "sync")


def test_flags_set_away_from_the_default_are_passed_and_explicit_values_given_to_training_options_win():
    args = script_parser().parse_args(["--sync", "--placement", "greedy", "--moving_average_decay", "0.9",
                                       "--wire_dtype", "bfloat16", "--replicas_to_aggregate", "1"])
    options = tfl.training_options(args)
    assert options["mode"] == "sync" and options["average_decay"] == 0.9 and options["sync"].replicas_to_aggregate == 1
    assert isinstance(options["placement"], tfl.GreedyByBytes)
    assert tfl.training_options(args, average_decay=0.5)["average_decay"] == 0.5
    assert "sync" not in tfl.training_options(script_parser().parse_args(["--replicas_to_aggregate", "1"]))
