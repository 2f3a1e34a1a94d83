"""ReplicaOptions and the TrainingReplica protocol: one validated options object, one interface for both replicas.

No sockets: Replica's constructor does not connect, and a one-tower ``Towers`` needs no process group.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.errors import InvalidArgumentError
from tensorfleet.parallel.towers import Towers
from tensorfleet.protocol.specs import Mode
from tensorfleet.worker.options import ReplicaOptions
from tensorfleet.worker.training_replica import TrainingReplica

CPU = torch.device("cpu")
CLUSTER = ClusterSpec.from_dict({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
SGD = tfl.OptimizerSpec.sgd(lr=0.1)
TRAIN = Path(tfl.__file__).parent / "train"


def replica(**kwargs) -> tfl.Replica:
    made = tfl.Replica(nn.Linear(2, 1), CLUSTER, TaskSpec("worker", 0), optimizer=SGD, **kwargs)
    made.client.close()  # built, never connected
    return made


def tower_replica(index: int = 0, num_towers: int = 1, **kwargs) -> tfl.TowerReplica:
    towers = Towers(tfl.TowerOptions(num_towers=num_towers), index, [CPU] * num_towers, None)
    towers.wrap = lambda module: module  # tower k of K without a process group: no DDP
    made = tfl.TowerReplica(towers, nn.Linear(2, 1), CLUSTER, TaskSpec("worker", 0), optimizer=SGD, **kwargs)
    if made.replica is not None:
        made.replica.client.close()
    return made


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "eventual"}, r"mode='eventual': choose 'async' or 'sync'"),
    ({"mode": "sync", "prefetch": True}, "prefetch=True needs async mode"),
])
def test_options_are_checked_once_with_the_messages_replica_always_gave(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        ReplicaOptions(**kwargs)
    with pytest.raises(InvalidArgumentError, match=match):
        replica(**kwargs)
    with pytest.raises(InvalidArgumentError, match=match):
        tower_replica(**kwargs)


def test_keywords_and_an_options_object_give_the_same_replica():
    keywords = {"mode": "sync", "average_decay": 0.99, "overlap": True, "wire_dtype": torch.bfloat16,
                "init_timeout_s": 5.0, "nonfinite_gradients": "apply"}
    options = ReplicaOptions(**keywords)
    assert options.mode is Mode.SYNC
    by_keywords, by_object = replica(**keywords), replica(config=options)
    assert by_keywords.options == by_object.options == options
    for made in (by_keywords, by_object):
        assert (made.mode, made.average_decay, made.overlap, made.prefetch, made.init_timeout_s,
                made.nonfinite_gradients) == (Mode.SYNC, 0.99, True, False, 5.0, "apply")
        assert made.sync.total_num_replicas == 2  # resolved against the cluster
    assert replica().options == ReplicaOptions()


def test_an_options_object_and_keywords_together_are_refused_naming_the_keywords():
    with pytest.raises(InvalidArgumentError, match="keyword option.s. average_decay, overlap given together"):
        replica(config=ReplicaOptions(), overlap=True, average_decay=0.5)
    with pytest.raises(InvalidArgumentError, match="keyword option.s. placement"):
        replica(config=ReplicaOptions(), placement=tfl.RoundRobin())  # another instance: given, not the default


@pytest.mark.parametrize("cls", [tfl.Replica, tfl.TowerReplica])
def test_every_keyword_of_both_replicas_is_an_option_with_the_same_default(cls):
    parameters = inspect.signature(cls.__init__).parameters
    keywords = {name: p.default for name, p in parameters.items()
                if p.kind is p.KEYWORD_ONLY and name not in ("optimizer", "config")}
    assert keywords == ReplicaOptions.defaults()
    config = ReplicaOptions(average_decay=0.5)
    assert ReplicaOptions.merge(config, **keywords) is config  # the signature's defaults count as not given


def test_training_options_still_leave_out_what_is_at_the_default():
    import argparse
    parser = argparse.ArgumentParser()
    tfl.add_training_flags(parser)
    assert tfl.training_options(parser.parse_args([])) == {}
    assert tfl.training_options(parser.parse_args(["--overlap", "--placement", "greedy"])).keys() == \
        {"overlap", "placement"}


def test_both_replicas_satisfy_the_protocol_the_session_drives():
    assert isinstance(replica(), TrainingReplica)
    assert isinstance(tower_replica(), TrainingReplica)


def test_the_protocol_names_everything_the_training_package_uses_of_a_replica():
    members = {name for name in vars(TrainingReplica) if not name.startswith("_")}
    used = set()
    for path in TRAIN.glob("*.py"):
        used |= set(re.findall(r"replica\.([a-z_]+)", path.read_text()))
    assert used and used <= members, f"used by tensorfleet.train but not in TrainingReplica: {used - members}"
    for made in (replica(), tower_replica()):
        assert all(hasattr(made, name) for name in members)


def test_tower_0_reads_its_replicas_ps_side():
    made = tower_replica(average_decay=0.9, mode="sync")
    inner = made.replica
    assert (made.client, made.placement, made.num_ps, made.optimizer) == \
        (inner.client, inner.placement, inner.num_ps, inner.optimizer)
    assert (made.mode, made.sync, made.average_decay, made.prefetch, made.overlap) == \
        (Mode.SYNC, inner.sync, 0.9, False, False)
    assert made.shard_steps == (0,) and made.init_timeout_s == 300.0 and made.nonfinite_gradients == "reject"
    assert made.options is inner.options


def test_other_towers_say_the_ps_side_lives_on_tower_0():
    made = tower_replica(index=1, num_towers=2)
    assert made.replica is None and not made.is_chief and made.options == ReplicaOptions()
    for name in ("client", "placement", "optimizer", "sync", "mode", "num_ps", "prefetch"):
        with pytest.raises(AttributeError, match=f"no '{name}' on this tower: the ps side of a worker .* tower 0"):
            getattr(made, name)
    with pytest.raises(AttributeError, match="no 'settle' on this tower"):
        made.settle()
    assert getattr(made, "prefetch", False) is False  # what StopAtStepHook asks


@pytest.mark.parametrize("option", ["overlap", "prefetch"])
def test_several_towers_refuse_overlap_and_prefetch_given_either_way(option):
    with pytest.raises(InvalidArgumentError, match="use towers or --" + option):
        tower_replica(num_towers=2, **{option: True})
    with pytest.raises(InvalidArgumentError, match="use towers or --" + option):
        tower_replica(num_towers=2, config=ReplicaOptions(**{option: True}))
