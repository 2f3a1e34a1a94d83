"""The pieces of embedding tables, without sockets: the id map, the row initializer, the table spec, one shard's
rows and their checkpoint state, and the EmbeddingTable layer's semantics against nn.Embedding(Bag)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tensorfleet.cluster.idhash import shard_of
from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer, TableSpec
from tensorfleet.protocol.state import ShardState, TableState
from tensorfleet.ps.idmap import IdMap
from tensorfleet.ps.table import EmbeddingShard, unique_ids_error
from tensorfleet.worker.embedding import EmbeddingTable, tables_of

SGD = OptimizerSpec("sgd", {"lr": 0.1})


def test_id_map_agrees_with_a_dict_over_any_int64_through_growth():
    rng = np.random.default_rng(1)
    ids = np.unique(np.concatenate([rng.integers(-2 ** 63, 2 ** 63 - 1, 20000, dtype=np.int64),
                                    np.array([0, -1, 2 ** 63 - 1, -2 ** 63], dtype=np.int64)]))
    rng.shuffle(ids)
    idmap, reference = IdMap(), {}
    for start in range(0, len(ids), 997):  # many growths of the table on the way
        chunk = ids[start:start + 997]
        assert (idmap.find(chunk) == -1).all()
        rows = idmap.insert(chunk)
        reference.update(zip(chunk.tolist(), rows.tolist()))
    assert len(idmap) == len(ids) and idmap.capacity * 0.75 >= len(ids)
    probe = np.concatenate([ids[::7], rng.integers(-2 ** 63, 2 ** 63 - 1, 3000, dtype=np.int64)])
    assert idmap.find(probe).tolist() == [reference.get(i, -1) for i in probe.tolist()]
    stored_ids, rows = idmap.items()
    assert rows.tolist() == list(range(len(ids))) and [reference[i] for i in stored_ids.tolist()] == rows.tolist()
    assert np.array_equal(idmap.ids(), stored_ids)  # the map's inverse, by row
    assert idmap.nbytes <= 21 * len(ids)  # the ids once (by row) and a row number per slot: no key per slot


def test_a_new_row_is_a_function_of_its_id_alone():
    init = RowInitializer.normal(0.5, seed=3)
    ids = torch.tensor([5, -9, 2 ** 62, 7])
    together = init.rows(ids, 6)
    alone = torch.cat([init.rows(ids[i:i + 1], 6) for i in range(4)])
    reversed_order = init.rows(ids.flip(0), 6).flip(0)
    assert torch.equal(together, alone) and torch.equal(together, reversed_order)
    assert not torch.equal(together, RowInitializer.normal(0.5, seed=4).rows(ids, 6))
    many = RowInitializer.normal(2.0, 1.0).rows(torch.arange(20000), 8)
    assert abs(many.mean().item() - 1.0) < 0.05 and abs(many.std().item() - 2.0) < 0.05
    uniform = RowInitializer.uniform(-0.1, 0.3).rows(torch.arange(5000), 4)
    assert uniform.min() >= -0.1 and uniform.max() < 0.3
    assert torch.equal(RowInitializer.constant(1.5).rows(ids, 2), torch.full((4, 2), 1.5))


def test_ids_spread_evenly_over_shards_even_when_they_come_in_runs():
    counts = np.bincount(shard_of(torch.arange(100000), 3), minlength=3)
    assert counts.min() > 32000 and counts.max() < 34700


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "a/b"}, "table name"),
    ({"name": "@x"}, "table name"),
    ({"dim": 0}, "dim=0"),
    ({"num_rows": -5}, "num_rows"),
    ({"optimizer": OptimizerSpec("rmsprop", {"lr": 0.1})}, "per row"),
    ({"optimizer": OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9})}, "momentum"),
    ({"dtype": torch.int64}, "floating point"),
])
def test_a_table_spec_refuses_what_the_ps_cannot_hold(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        TableSpec(**{"name": "t", "dim": 4, "optimizer": SGD, **kwargs})


def test_a_table_spec_round_trips_through_its_wire_meta():
    spec = TableSpec("user.v2", 8, OptimizerSpec("adam", {"lr": 0.01, "betas": [0.8, 0.9]}), num_rows=100,
                     initializer=RowInitializer.uniform(-1, 1, seed=9))
    assert TableSpec.from_meta(spec.to_meta()) == spec


def test_a_shard_state_round_trips_tables_through_its_flat_names():
    table = TableState(torch.tensor([3, -1]), torch.ones(2, 4), {"sum": torch.zeros(2, 4)})
    state = ShardState({"w": torch.ones(2)}, {}, None, 7, 7, {"user": table})
    back = ShardState.unflatten(state.flatten(), global_step=7, applied_updates=7)
    assert set(state.flatten()) == {"value/w", "table/user/ids", "table/user/values", "table/user/slot/sum"}
    assert torch.equal(back.tables["user"].ids, table.ids) and torch.equal(back.tables["user"].slots["sum"],
                                                                          table.slots["sum"])
    with pytest.raises(InvalidArgumentError, match="one row per id"):
        TableState(torch.tensor([1, 2]), torch.ones(3, 4))


def test_a_shard_creates_rows_on_update_only_and_restores_its_state():
    spec = TableSpec("t", 3, OptimizerSpec("adagrad", {"lr": 0.5, "initial_accumulator_value": 0.1}))
    shard = EmbeddingShard(spec)
    ids = torch.tensor([10, -20, 2 ** 50])
    assert torch.equal(shard.lookup(ids), spec.initializer.rows(ids, 3)) and len(shard) == 0
    shard.apply(ids[:2], torch.ones(2, 3), 0.5)
    assert len(shard) == 2 and shard.rows_created == 2
    copy = EmbeddingShard(spec)
    copy.load(shard.state())
    assert torch.equal(copy.lookup(ids), shard.lookup(ids))
    shard.apply(ids, torch.ones(3, 3), 0.5)
    copy.apply(ids, torch.ones(3, 3), 0.5)  # the slots came along: the same next update
    assert torch.equal(copy.lookup(ids), shard.lookup(ids))
    assert unique_ids_error(torch.tensor([4, 5, 4])) == "id 4 appears twice (sum its gradients on the worker)"


def test_an_unbound_table_is_nn_embedding_and_embedding_bag_over_its_rows():
    table = EmbeddingTable("t", 3, optimizer=SGD)
    ids = torch.tensor([[7, -2], [7, 99]])
    rows = TableState(torch.tensor([7, -2, 99]), torch.arange(9.0).view(3, 3))
    table.load_rows(rows)
    plain = nn.Embedding.from_pretrained(rows.values)
    index = torch.tensor([[0, 1], [0, 2]])
    assert torch.equal(table(ids), plain(index))
    unknown = table(torch.tensor([12345]))  # no row: its initial value, as the ps would answer
    assert torch.equal(unknown, table.spec().initializer.rows(torch.tensor([12345]), 3))

    bags = EmbeddingTable("b", 3, pooling="mean", optimizer=SGD)
    bags.load_rows(rows)
    flat, offsets = torch.tensor([7, -2, 99, 7]), torch.tensor([0, 3])
    expected = nn.EmbeddingBag.from_pretrained(rows.values, mode="mean")(torch.tensor([0, 1, 2, 0]), offsets)
    assert torch.allclose(bags(flat, offsets), expected)
    assert torch.allclose(bags(ids), nn.EmbeddingBag.from_pretrained(rows.values, mode="mean")(index))


@pytest.mark.parametrize("call, message", [
    (lambda t: t(torch.tensor([1.0])), "int64"),
    (lambda t: t(torch.tensor([1, 2]), torch.tensor([1])), "offsets must start at 0"),
    (lambda t: t(torch.tensor([1, 2]), torch.tensor([0, 3])), "within the 2 ids"),
    (lambda t: t(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])), "never decrease"),
    (lambda t: t(torch.tensor([1, 2])), "bags need 2-D ids"),
])
def test_a_bag_table_says_what_is_wrong_with_its_input(call, message):
    with pytest.raises(InvalidArgumentError, match=message):
        call(EmbeddingTable("t", 2, pooling="sum", optimizer=SGD))


def test_a_fixed_size_table_refuses_ids_outside_it():
    table = EmbeddingTable("t", 2, num_rows=10, optimizer=SGD)
    assert table(torch.tensor([0, 9])).shape == (2, 2)
    with pytest.raises(InvalidArgumentError, match="got id 10"):
        table(torch.tensor([3, 10]))
    with pytest.raises(InvalidArgumentError, match="got id -1"):
        table(torch.tensor([-1]))


def test_gradients_of_a_step_are_summed_per_unique_id_over_forward_calls():
    table = EmbeddingTable("t", 2, optimizer=SGD)
    table.bind(lambda ids: torch.zeros(len(ids), 2))
    (table(torch.tensor([4, 5, 4])).sum() + 2 * table(torch.tensor([5, 6])).sum()).backward()
    ids, grads = table.take_gradients()
    assert ids.tolist() == [4, 5, 6] and grads[:, 0].tolist() == [2.0, 3.0, 2.0]
    assert table.take_gradients() is None  # taken: the next step starts empty
    with torch.no_grad():
        table(torch.tensor([1]))
    assert table.take_gradients() is None  # evaluation records nothing


def test_two_tables_may_not_share_a_name():
    with pytest.raises(InvalidArgumentError, match="two EmbeddingTables are named 'x'"):
        tables_of(nn.ModuleList([EmbeddingTable("x", 2), EmbeddingTable("x", 2)]))
