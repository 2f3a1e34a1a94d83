"""Sync aggregation rules, without sockets: mean of R, one step per aggregation, stale and duplicate drops."""

import threading

import pytest
import torch

from tensorfleet.errors import DeadlineExceededError, InvalidArgumentError
from tensorfleet.ps.aggregate import SyncAccumulator
from tensorfleet.protocol.specs import OptimizerSpec, SyncOptions
from tensorfleet.protocol.messages import Outcome
from tensorfleet.ps.store import VariableStore

NAMES = ["/job:worker/task:0", "/job:worker/task:1", "/job:worker/task:2"]


def test_mean_of_r_gradients_then_next_step():
    acc = SyncAccumulator(SyncOptions(2, 3))
    assert acc.offer(0, 0, {"w": torch.tensor([1.0, 2.0])}) is Outcome.ACCEPTED
    assert acc.offer(2, 0, {"w": torch.tensor([3.0, 6.0])}) is Outcome.COMPLETE
    assert torch.equal(acc.take_mean()[0]["w"], torch.tensor([2.0, 4.0]))
    assert acc.step == 1 and acc.contributors == ()


def test_late_gradient_is_stale_and_counted():
    acc = SyncAccumulator(SyncOptions(1, 2))
    acc.offer(0, 0, {"w": torch.ones(1)})
    acc.take_mean()
    assert acc.offer(1, 0, {"w": torch.ones(1)}) is Outcome.STALE
    assert acc.dropped_stale == 1 and acc.contributors == ()


def test_duplicate_from_same_replica_is_dropped():
    acc = SyncAccumulator(SyncOptions(2, 2))
    acc.offer(0, 0, {"w": torch.ones(1)})
    assert acc.offer(0, 0, {"w": torch.ones(1)}) is Outcome.DUPLICATE
    assert acc.dropped_duplicate == 1 and acc.contributors == (0,)


def test_step_from_the_future_is_refused():
    acc = SyncAccumulator(SyncOptions(2, 2))
    with pytest.raises(InvalidArgumentError, match="step from the future"):
        acc.offer(0, 1, {"w": torch.ones(1)})


def test_accumulator_does_not_alias_the_callers_gradient():
    acc = SyncAccumulator(SyncOptions(2, 2))
    grad = torch.ones(2)
    acc.offer(0, 0, {"w": grad})
    acc.offer(1, 0, {"w": torch.ones(2)})
    acc.take_mean()
    assert torch.equal(grad, torch.ones(2))


@pytest.mark.parametrize("options, message", [
    (SyncOptions(3, 2), "replicas_to_aggregate"),
    (SyncOptions(0, 2), "replicas_to_aggregate"),
    (SyncOptions(1, 1, timeout_s=0), "timeout_s"),
    (SyncOptions(1, 1, on_missing="skip"), "on_missing"),
])
def test_invalid_options(options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        options.check()


def test_defaults_resolve_from_cluster_and_total_must_match_it():
    assert SyncOptions().resolve(3) == SyncOptions(3, 3)
    assert SyncOptions(replicas_to_aggregate=2).resolve(3) == SyncOptions(2, 3)
    for total in (2, 4):
        with pytest.raises(InvalidArgumentError, match="the cluster has 3 training task"):
            SyncOptions(total_num_replicas=total).resolve(3)


def sync_store(r: int, n: int, **kwargs) -> VariableStore:
    store = VariableStore(task="/job:ps/task:0", replica_names=NAMES[:n])
    store.initialize({"w": torch.zeros(2)}, OptimizerSpec.sgd(lr=1.0), SyncOptions(r, n, **kwargs))
    return store


def test_store_applies_once_per_aggregation_and_all_waiters_see_it():
    store = sync_store(2, 2)
    results = {}

    def push(replica, value):
        results[replica] = store.push_sync(replica, 0, {"w": torch.full((2,), value)})

    threads = [threading.Thread(target=push, args=(r, v)) for r, v in ((0, 1.0), (1, 3.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    # Whichever came first waited for the other; both return after the one aggregation.
    assert sorted(results.values(), key=lambda r: r[1].value) == [(1, Outcome.ACCEPTED), (1, Outcome.COMPLETE)]
    values, step = store.read()
    assert step == 1 and torch.equal(values["w"], torch.full((2,), -2.0))  # 0 - 1.0 * mean(1, 3)
    assert store.status().applied_updates == 1


def test_missing_worker_times_out_with_its_name_and_keeps_the_gradient():
    store = sync_store(2, 2, timeout_s=0.2)
    with pytest.raises(DeadlineExceededError, match=r"missing: /job:worker/task:1") as caught:
        store.push_sync(0, 0, {"w": torch.ones(2)})
    assert "gathered 1 of 2" in str(caught.value) and "backup workers" in str(caught.value)
    assert store.read()[1] == 0
    # The step is not lost: when the missing worker comes back, it completes it.
    assert store.push_sync(1, 0, {"w": torch.ones(2)}) == (1, Outcome.COMPLETE)


def test_on_missing_continue_applies_what_arrived():
    store = sync_store(2, 2, timeout_s=0.2, on_missing="continue")
    assert store.push_sync(0, 0, {"w": torch.full((2,), 4.0)})[0] == 1
    assert torch.equal(store.read()[0]["w"], torch.full((2,), -4.0))


def test_sync_push_must_carry_every_variable_and_a_known_replica():
    store = VariableStore(task="t", replica_names=NAMES[:2])
    store.initialize({"w": torch.zeros(2), "b": torch.zeros(1)}, OptimizerSpec.sgd(lr=1.0), SyncOptions(2, 2))
    with pytest.raises(InvalidArgumentError, match="missing"):
        store.push_sync(0, 0, {"w": torch.ones(2)})
    with pytest.raises(InvalidArgumentError, match="replica 5"):
        store.push_sync(5, 0, {"w": torch.ones(2), "b": torch.ones(1)})
    with pytest.raises(InvalidArgumentError, match="sync mode"):
        store.apply({"w": torch.ones(2)}, advance_step=True)
    assert store.status().applied_updates == 0 and store.status().dropped_stale == 0
