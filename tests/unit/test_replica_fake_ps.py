"""Replica's step against a fake ps (tests/unit/fake_ps.py): pull, push, sync tags, drops, prefetch, overlap.

No sockets and no processes: ``Replica`` builds a ``FakePsClient`` instead of a ``PsClient``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from fake_ps import FakePsClient, install
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.errors import InvalidArgumentError
from tensorfleet.parallel.towers import Towers
from tensorfleet.protocol.specs import Mode
from tensorfleet.protocol.messages import Outcome
from tensorfleet.worker.replica import Replica

LR = 0.1
CLUSTER = ClusterSpec.from_dict({"ps": ["127.0.0.1:1", "127.0.0.1:2"], "worker": ["127.0.0.1:3", "127.0.0.1:4"]})
CHIEF, WORKER = TaskSpec("worker", 0), TaskSpec("worker", 1)


class Net(nn.Module):
    """Two layers, one of them never used: its gradient is None after backward."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 2)
        self.unused = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.fixture
def fakes(monkeypatch) -> list[FakePsClient]:
    torch.manual_seed(0)
    return install(monkeypatch)


def started(fakes, *, task=CHIEF, **kwargs) -> tuple[Replica, Net, FakePsClient]:
    model = Net()
    replica = Replica(model, CLUSTER, task, optimizer=tfl.OptimizerSpec.sgd(lr=LR), **kwargs)
    return replica, model, fakes[-1]


def backward(model: Net) -> None:
    model(torch.ones(4, 3)).pow(2).sum().backward()


def values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_values(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        torch.testing.assert_close(actual[name], expected[name], msg=name)


def test_the_chief_initializes_the_ps_with_its_module_and_optimizer(fakes):
    replica, model, ps = started(fakes, average_decay=0.9)
    initial = values(model)
    replica.start()
    init = dict(ps.calls)["initialize"]
    assert (init["optimizer"], init["sync"], init["average_decay"], init["nonfinite"]) == \
        (tfl.OptimizerSpec.sgd(lr=LR), None, 0.9, "reject")
    assert_values(ps.values, initial)
    assert replica.global_step == 0


def test_pull_fills_the_module_with_the_ps_values(fakes):
    replica, model, ps = started(fakes, task=WORKER)
    on_ps = {name: torch.full_like(value, 3.0) for name, value in values(model).items()}
    ps.initialized_by_chief(on_ps, lr=LR)
    ps.shard_steps = [7, 7]
    assert replica.start().global_step == 7  # a worker only waits; start pulls once
    assert "initialize" not in dict(ps.calls)
    assert_values(values(model), on_ps)
    with torch.no_grad():
        model.used.weight.zero_()
    assert replica.pull() == 7
    assert_values(values(model), on_ps)


def test_push_sends_every_gradient_zeros_for_unused_ones_then_takes_the_reply(fakes):
    replica, model, ps = started(fakes)
    replica.start()
    before = values(model)
    backward(model)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == {"used.weight", "used.bias"}

    assert replica.push() == 1
    sent = [call for name, call in ps.calls if name == "push"][-1]
    assert_values(sent["gradients"], {**grads, "unused.weight": torch.zeros(2, 3), "unused.bias": torch.zeros(2)})
    assert sent["sync_steps"] is None and sent["replica"] == 0
    assert all(p.grad is None for p in model.parameters())
    expected = {name: before[name] - LR * sent["gradients"][name] for name in before}
    assert_values(values(model), expected)  # the reply's values, already in the module
    assert (replica.global_step, replica.dropped_gradients) == (1, 0)

    pulls = len([name for name, _ in ps.calls if name == "pull"])
    assert replica.pull() == 1
    assert len([name for name, _ in ps.calls if name == "pull"]) == pulls  # free right after a push


def test_sync_push_is_tagged_with_the_step_each_shard_served(fakes):
    replica, model, ps = started(fakes, mode="sync", sync=tfl.SyncOptions(replicas_to_aggregate=1, timeout_s=30.0))
    replica.start()
    assert ps.mode is Mode.SYNC and replica.sync.replicas_to_aggregate == 1
    ps.shard_steps = [4, 9]  # the shards served different steps at the last pull
    replica.pull()  # the push's values were not brought back yet: a real pull
    assert replica.shard_steps == (4, 9)

    backward(model)
    replica.push()
    sent = [call for name, call in ps.calls if name == "push"][-1]
    assert (sent["sync_steps"], sent["replica"], sent["timeout_s"]) == ([4, 9], 0, 30.0 + 60.0)
    assert replica.shard_steps == (5, 10)


def test_a_push_the_ps_drops_counts_one_dropped_gradient_and_changes_nothing(fakes):
    replica, model, ps = started(fakes, mode="sync")
    replica.start()
    before = values(model)
    ps.outcomes = [Outcome.STALE]
    backward(model)
    assert replica.push() == 0
    assert replica.dropped_gradients == 1
    assert_values(values(model), before)
    assert all(p.grad is None for p in model.parameters())
    backward(model)
    replica.push()
    assert (replica.global_step, replica.dropped_gradients) == (1, 1)


def test_prefetch_push_returns_before_the_reply_and_settle_takes_it(fakes):
    replica, model, ps = started(fakes, prefetch=True)
    replica.start()
    before = values(model)
    backward(model)
    assert replica.push() == 0  # the step before this push's
    in_flight = replica._in_flight._gathered
    assert in_flight is not None and not in_flight.waited  # nobody waited for the reply
    assert all(p.grad is None for p in model.parameters())
    assert_values(values(model), before)  # the next step computes on the values held
    assert replica.pull() == 0  # free: values arrive with the next push or settle
    assert not in_flight.waited

    assert replica.settle() == 1
    assert in_flight.waited and not replica._in_flight.travelling
    sent = [call for name, call in ps.calls if name == "push"][-1]
    assert_values(values(model), {name: before[name] - LR * sent["gradients"][name] for name in before})
    assert replica.settle() == 1  # nothing in flight: a no-op


def test_prefetch_takes_the_previous_reply_at_the_next_push(fakes):
    replica, model, ps = started(fakes, prefetch=True)
    replica.start()
    backward(model)
    replica.push()
    first = replica._in_flight._gathered
    backward(model)
    replica.push()
    assert first.waited and replica.global_step == 1  # the first push landed; the second travels
    replica.finish()  # settles the last one before saying done
    assert replica.global_step == 2 and dict(ps.calls)["done"] == {"replica": 0} and ps.closed


def test_overlap_streams_each_gradient_during_backward_last_layer_first(fakes):
    replica, model, ps = started(fakes, overlap=True)
    replica.start()
    before = values(model)
    backward(model)
    (streams,) = ps.streams
    assert list(streams.sent) == ["used.bias", "used.weight"]  # backward's order, before push()
    assert list(streams.layout) == ["unused.bias", "unused.weight", "used.bias", "used.weight"]
    replica.push()
    assert set(streams.sent) == set(before)  # the unused layer's zeros joined at push()
    assert torch.equal(streams.sent["unused.weight"], torch.zeros(2, 3))
    sent = [call for name, call in ps.calls if name == "push"][-1]
    assert_values(values(model), {name: before[name] - LR * sent["gradients"][name] for name in before})
    assert replica.global_step == 1 and all(p.grad is None for p in model.parameters())


def test_overlap_refuses_two_backward_passes_before_push_and_pushes_nothing(fakes):
    replica, model, ps = started(fakes, overlap=True)
    replica.start()
    before = values(model)
    backward(model)
    backward(model)  # gradient accumulation: not with overlap
    with pytest.raises(InvalidArgumentError, match=r"gradient of 'used\.(weight|bias)' was produced twice before "
                                                   r"push\(\): overlap=True needs exactly one backward per push; "
                                                   "nothing was pushed"):
        replica.push()
    assert ps.streams[0].aborted and "push" not in dict(ps.calls)
    assert_values(ps.values, before) and replica.global_step == 0
    for param in model.parameters():
        param.grad = None
    backward(model)
    replica.push()  # the next step streams afresh
    assert replica.global_step == 1 and len(ps.streams) == 2


def test_load_averages_pulls_the_averages_and_the_next_pull_brings_the_values_back(fakes):
    replica, model, ps = started(fakes)
    replica.start()
    replica.load_averages()
    assert ("pull", {"averages": True}) in ps.calls
    replica.pull()
    assert ps.calls[-1] == ("pull", {"averages": False})


def test_a_one_tower_tower_replica_drives_its_replica_through_the_same_step(fakes):
    towers = Towers(tfl.TowerOptions(num_towers=1), 0, [torch.device("cpu")], None)
    model = Net()
    replica = tfl.TowerReplica(towers, model, CLUSTER, CHIEF, optimizer=tfl.OptimizerSpec.sgd(lr=LR), prefetch=True)
    ps = fakes[-1]
    replica.start()
    before = values(model)
    backward(replica.model)
    assert replica.push() == 0 and replica.client is ps and replica.prefetch
    assert replica.settle() == 1  # delegated to tower 0's Replica
    sent = [call for name, call in ps.calls if name == "push"][-1]
    assert_values(values(model), {name: before[name] - LR * sent["gradients"][name] for name in before})
    replica.finish()
    assert ps.closed


def test_overlap_hooks_go_with_finish_and_exist_only_with_overlap(fakes):
    replica, model, ps = started(fakes, overlap=True)
    replica.start()
    replica.finish()
    backward(model)  # evaluation after training: nothing streams
    assert ps.streams == [] and model.used.weight.grad is not None
    plain, _, _ = started(fakes)
    assert plain._streaming is None


def test_training_that_raises_closes_the_replica_without_saying_done(fakes):
    """A Done from a failed worker would let the ps finish, and sync steps go on, without its restart."""
    replica, model, ps = started(fakes)
    with pytest.raises(RuntimeError, match="the data ran dry"):
        with replica:
            backward(model)
            replica.push()
            raise RuntimeError("the data ran dry")
    assert "done" not in dict(ps.calls) and ps.closed and replica.status.state == "failed"

    replica, model, ps = started(fakes, task=WORKER)
    ps.initialized_by_chief(values(model), lr=LR)
    with pytest.raises(RuntimeError, match="a bad batch"):
        with tfl.TrainingSession(replica, log_step_count_steps=None, summary_dir=False):
            raise RuntimeError("a bad batch")
    assert "done" not in dict(ps.calls) and ps.closed

    class FailingLastSave(tfl.Hook):
        def end(self, session) -> None:
            raise OSError("the disk is full")

    replica, model, ps = started(fakes)
    with pytest.raises(OSError, match="the disk is full"):
        with tfl.TrainingSession(replica, hooks=[FailingLastSave()], log_step_count_steps=None, summary_dir=False):
            pass
    assert "done" not in dict(ps.calls) and ps.closed  # a hook's end() failing fails the worker too

    replica, model, ps = started(fakes)
    with tfl.TrainingSession(replica, log_step_count_steps=None, summary_dir=False):
        pass
    assert dict(ps.calls)["done"] == {"replica": 0} and ps.closed and replica.status.state == "done"
