"""Prefetch (async): each push travels while the next step computes, on values exactly one update older."""

import pytest
import torch
from torch import nn

from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import InvalidArgumentError, UnavailableError
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.worker.embedding import EmbeddingTable
from tensorfleet.worker.replica import Replica

STEPS = 6


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            param.fill_(float(10 * (i + 1)))
    return model


def test_prefetch_needs_async_mode():
    with ps_servers(num_ps=1, num_workers=1) as (cluster, _):
        with pytest.raises(InvalidArgumentError, match="needs async mode"):
            Replica(_model(), cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=1.0), mode="sync",
                    prefetch=True)


@pytest.mark.parametrize("overlap", [False, True], ids=["after-backward", "overlap"])
def test_each_step_computes_on_the_values_one_update_older_and_settle_lands_the_last(overlap):
    """SGD with lr 1 on the sum of the parameters: every update subtracts exactly 1 from each value.
    Step k (from 0) computes on the initial values minus max(k - 1, 0), and nothing is lost at the end."""
    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        model = _model()
        start = [p.detach().clone() for p in model.parameters()]
        seen = []
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=1.0), prefetch=True,
                     overlap=overlap) as replica:
            for _ in range(STEPS):
                replica.pull()
                seen.append([p.detach().clone() for p in model.parameters()])
                sum(p.sum() for p in model.parameters()).backward()
                replica.push()
            assert replica.settle() == STEPS
            assert servers[0].store.status().global_step == STEPS
            for step, values in enumerate(seen):
                assert all(torch.equal(v, s - max(step - 1, 0)) for v, s in zip(values, start)), step
            assert all(torch.equal(p.detach(), s - STEPS) for p, s in zip(model.parameters(), start))
            replica.pull()  # after settle: a real pull, the same values
            assert all(torch.equal(p.detach(), s - STEPS) for p, s in zip(model.parameters(), start))


def test_finishing_lands_the_push_in_flight():
    with ps_servers(num_ps=1, num_workers=1) as (cluster, servers):
        model = _model()
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=1.0),
                     prefetch=True) as replica:
            sum(p.sum() for p in model.parameters()).backward()
            assert replica.push() == 0  # the step before this push: its reply has not been waited for
        assert replica.global_step == 1 and servers[0].store.status().applied_updates == 1


def test_an_error_of_the_push_in_flight_is_raised_by_the_next_call():
    with ps_servers(num_ps=1, num_workers=1) as (cluster, servers):
        model = _model()
        replica = Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=1.0), prefetch=True,
                          init_timeout_s=10)
        replica.start()
        try:
            sum(p.sum() for p in model.parameters()).backward()
            replica.push()
            assert replica.settle() == 1
            servers[0].stop()
            sum(p.sum() for p in model.parameters()).backward()
            replica.push()  # returns at once; its failure waits for the next call
            with pytest.raises(UnavailableError):
                replica.settle()
            assert replica.settle() == 1  # raised once; nothing is in flight any more
        finally:
            replica.client.close()


# --- Replica.prefetch_rows: the tables' rows of a batch in one request per shard (issue 29: keyed by table) ------

class TwoTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = EmbeddingTable("user", 4, optimizer=OptimizerSpec("sgd", {"lr": 0.1}))
        self.item = EmbeddingTable("item", 4, optimizer=OptimizerSpec("sgd", {"lr": 0.1}))


def counted_lookups(replica: Replica) -> list[str]:
    """The data-plane calls of ``replica`` from now on, by method name."""
    calls: list[str] = []
    for data in replica.client.data:
        call = data.call
        data.call = lambda method, *a, _call=call, **k: (calls.append(method), _call(method, *a, **k))[1]
    return calls


def test_prefetch_rows_takes_the_tables_themselves_as_well_as_their_names():
    users, items = torch.arange(20), torch.arange(100, 120)  # ids on both shards
    with ps_servers(num_ps=2, num_workers=1) as (cluster, _):
        model = TwoTables()
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            calls = counted_lookups(replica)
            expected = (model.user(users).detach(), model.item(items).detach())
            assert calls.count("Lookup") == 4  # without prefetch_rows: each table asks each shard
            for keys in ((model.user, model.item), ("user", "item"), (model.user, "item")):
                calls.clear()
                replica.prefetch_rows(dict(zip(keys, (users, items))))
                got = (model.user(users).detach(), model.item(items).detach())
                assert calls.count("Lookup") == 2, keys  # one request per shard for both tables
                assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("key, says", [
    ("users", r"prefetch_rows: 'users' is not one of this model's EmbeddingTables: give the table itself or its "
              r"name, one of \['item', 'user'\]"),
    ("foreign", r"prefetch_rows: EmbeddingTable 'user' is not one of this model's EmbeddingTables"),
    (7, r"prefetch_rows: 7 is not one of this model's EmbeddingTables"),
])
def test_prefetch_rows_of_a_table_the_model_does_not_have_names_it(key, says):
    with ps_servers(num_ps=1, num_workers=1) as (cluster, _):
        model = TwoTables()
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            key = EmbeddingTable("user", 4) if key == "foreign" else key  # another module of the same name
            with pytest.raises(InvalidArgumentError, match=says) as caught:
                replica.prefetch_rows({key: torch.arange(3)})
            assert "EmbeddingTable(" not in str(caught.value)  # the key's name, not the module's repr
            with pytest.raises(InvalidArgumentError, match="the table 'user' is given twice"):
                replica.prefetch_rows({model.user: torch.arange(3), "user": torch.arange(3)})
