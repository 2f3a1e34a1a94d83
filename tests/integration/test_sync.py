"""Sync training against real ps servers on 127.0.0.1; workers are threads, each with its own Replica.

The equivalence test is the proof of the aggregation: N workers with batch b in
sync mode end where one process with batch N*b on the union of their batches ends.
"""

import copy
import threading

import pytest
import torch
from torch import nn

from tensorfleet.cluster.placement import GreedyByBytes, RoundRobin, RowPartitioner
from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import DeadlineExceededError, InvalidArgumentError
from tensorfleet.protocol.specs import OptimizerSpec, SyncOptions
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.testing.models import run_workers, seeded_mlp, sgd_on_union_batches
from tensorfleet.worker.replica import Replica

STEPS, BATCH, LR = 20, 8, 0.1


INITIAL = seeded_mlp(12, 16, 3, scale=0.3)


def make_model() -> nn.Module:
    """The same initial values every time, without touching torch's global RNG (workers are threads)."""
    return copy.deepcopy(INITIAL)


def batch_for(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(BATCH, 12, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator)


@pytest.mark.parametrize("overlap", [False, True], ids=["after-backward", "overlap"])
@pytest.mark.parametrize("num_workers, strategy, partitioner", [
    (2, RoundRobin(), None),
    (3, RoundRobin(), None),
    (2, GreedyByBytes(), RowPartitioner(num_parts=3)),  # the partitioned variables' round trip, trained
])
def test_sync_equals_one_process_with_the_union_batch(num_workers, strategy, partitioner, overlap):
    reference = sgd_on_union_batches(make_model(), batch_for, num_workers=num_workers, steps=STEPS, lr=LR)

    with ps_servers(num_ps=2, num_workers=num_workers) as (cluster, servers):
        def worker(index):
            model = make_model()
            with Replica(model, cluster, TaskSpec("worker", index), optimizer=OptimizerSpec.sgd(lr=LR),
                         mode="sync", placement=strategy, partitioner=partitioner, overlap=overlap) as replica:
                for step in range(STEPS):
                    assert replica.global_step == step  # every worker starts step k from aggregation k
                    x, y = batch_for(step, index)
                    nn.functional.cross_entropy(model(x), y).backward()
                    replica.push()
                    replica.pull()
                return {n: p.detach().clone() for n, p in model.named_parameters()}

        finals = run_workers(num_workers, worker)
        assert servers[0].store.status().global_step == STEPS
        assert servers[0].store.status().applied_updates == STEPS
        assert all(s.store.status().dropped_stale == 0 for s in servers)
    for name, expected in reference.named_parameters():
        for final in finals:
            torch.testing.assert_close(final[name], expected.detach(), rtol=1e-5, atol=1e-6)


def test_backup_worker_slow_one_is_dropped_and_nobody_waits_for_it():
    target_steps = 20
    with ps_servers(num_ps=2, num_workers=3) as (cluster, servers):
        sync = SyncOptions(replicas_to_aggregate=2, total_num_replicas=3, timeout_s=30)
        everyone_pulled_step_0 = threading.Barrier(3, timeout=30)

        def worker(index):
            model = make_model()
            pushes = dropped = 0
            with Replica(model, cluster, TaskSpec("worker", index), optimizer=OptimizerSpec.sgd(lr=LR),
                         mode="sync", sync=sync) as replica:
                while replica.global_step < target_steps:
                    pulled_step = replica.pull()
                    if pushes == 0:  # so the straggler has a step-0 gradient to be late with
                        everyone_pulled_step_0.wait()
                    if pulled_step >= target_steps:
                        break
                    x, y = batch_for(pulled_step, index)
                    nn.functional.cross_entropy(model(x), y).backward()
                    if index == 2:  # the straggler: its gradient arrives after every shard moved past its tag
                        tags = replica.shard_steps  # shards may be a step apart while pushes are in flight
                        if max(tags) >= target_steps:
                            break
                        while any(server.store.status().global_step <= tag for server, tag in zip(servers, tags)):
                            threading.Event().wait(0.005)
                    replica.push()
                    pushes += 1
                dropped = replica.dropped_gradients
            return pushes, dropped

        (p0, d0), (p1, d1), (p2, d2) = run_workers(3, worker)
        final = servers[0].store.status()
        # Exactly one step per aggregation; every fast push counted toward one; every slow push dropped.
        assert final.global_step == final.applied_updates == target_steps
        assert d0 == d1 == 0 and p0 + p1 == 2 * target_steps
        assert p2 >= 1 and d2 == p2
        assert final.dropped_stale == p2 and servers[1].store.status().dropped_stale == p2


def test_missing_worker_without_backup_fails_with_its_name_over_rpc():
    with ps_servers(num_ps=1, num_workers=2) as (cluster, _):
        model = make_model()
        replica = Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=LR),
                          mode="sync", sync=SyncOptions(timeout_s=0.5)).start()
        nn.functional.cross_entropy(model(batch_for(0, 0)[0]), batch_for(0, 0)[1]).backward()
        with pytest.raises(DeadlineExceededError, match=r"missing: /job:worker/task:1"):
            replica.push()
        replica.client.close()


def test_a_worker_in_the_wrong_mode_is_told_so():
    with ps_servers(num_ps=1, num_workers=2) as (cluster, _):
        chief = Replica(make_model(), cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=LR),
                        mode="sync").start()
        other = Replica(make_model(), cluster, TaskSpec("worker", 1), optimizer=OptimizerSpec.sgd(lr=LR))
        with pytest.raises(InvalidArgumentError, match="started in async mode, but the job runs in sync mode"):
            other.start()
        for replica in (chief, other):
            replica.client.close()


def test_partitioned_variable_round_trip_over_two_shards():
    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        model = nn.Linear(4, 7)  # weight (7, 4) -> 3 parts of 3, 2, 2 rows; bias (7,) -> 3 parts
        initial = copy.deepcopy(model.state_dict())
        replica = Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=1.0),
                          partitioner=RowPartitioner(num_parts=3)).start()
        held = {**servers[0].store.read()[0], **servers[1].store.read()[0]}
        assert sorted(held) == [f"{v}/part_{i}" for v in ("bias", "weight") for i in range(3)]
        assert torch.equal(torch.cat([held[f"weight/part_{i}"] for i in range(3)]), initial["weight"])
        model.weight.grad, model.bias.grad = torch.ones(7, 4), torch.arange(7.0)
        replica.push()
        with torch.no_grad():
            model.weight.zero_()
            model.bias.zero_()
        replica.pull()  # reassembled from the parts on both shards
        assert torch.equal(model.weight.detach(), initial["weight"] - 1.0)
        assert torch.equal(model.bias.detach(), initial["bias"] - torch.arange(7.0))
        replica.client.close()


def test_straggler_waiting_at_the_end_is_released_when_the_others_finish():
    with ps_servers(num_ps=1, num_workers=3) as (cluster, servers):
        sync = SyncOptions(replicas_to_aggregate=2, total_num_replicas=3, timeout_s=60)
        replicas = [Replica(make_model(), cluster, TaskSpec("worker", i), optimizer=OptimizerSpec.sgd(lr=LR),
                            mode="sync", sync=sync) for i in range(3)]
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.module(batch_for(0, 0)[0]).sum().backward()
        released = []
        straggler = threading.Thread(target=lambda: released.append(replicas[2].push()), daemon=True)
        straggler.start()  # its gradient for step 0 waits for a second one...
        replicas[0].finish()  # ...which never comes: the other two finish instead
        replicas[1].finish()
        straggler.join(timeout=20)  # far below the 60 s sync timeout
        assert not straggler.is_alive(), "the straggler was left waiting after the others finished"
        assert released == [0] and replicas[2].dropped_gradients == 1
        assert servers[0].store.status().applied_updates == 0
        replicas[2].finish()


def test_moving_averages_update_once_per_aggregation_and_load_into_the_model():
    with ps_servers(num_ps=2, num_workers=2) as (cluster, _):
        def worker(index):
            model = make_model()
            snapshot = lambda: {n: p.detach().clone() for n, p in model.named_parameters()}  # noqa: E731
            with Replica(model, cluster, TaskSpec("worker", index), optimizer=OptimizerSpec.sgd(lr=LR),
                         mode="sync", average_decay=0.5) as replica:
                history = [snapshot()]  # the initial values, then the values after each aggregation
                for step in range(3):
                    x, y = batch_for(step, index)
                    nn.functional.cross_entropy(model(x), y).backward()
                    replica.push()
                    replica.pull()
                    history.append(snapshot())
                replica.load_averages()
                averaged = snapshot()
                replica.pull()  # the training values come back
                return history, averaged, snapshot()

        (history, averaged, restored), _ = run_workers(2, worker)
    # One update per aggregation (not per push): shadow -= (1 - min(0.5, (1+n)/(10+n))) * (shadow - value_n).
    for name, initial in history[0].items():
        shadow = initial.clone()
        for n, values in enumerate(history[1:]):
            shadow -= (1 - min(0.5, (1 + n) / (10 + n))) * (shadow - values[name])
        torch.testing.assert_close(averaged[name], shadow)
        assert torch.equal(restored[name], history[-1][name])
