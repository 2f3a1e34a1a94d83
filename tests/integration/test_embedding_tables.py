"""Embedding tables on real ps servers (127.0.0.1, in this process; workers are threads).

The proofs: a model with tables and dense layers trained in sync mode by N workers with
batch b ends where one local process ends with batch N*b (tables as plain full-size
parameters there, Adagrad on them, which leaves untouched rows alone); async per-row
SGD, Adagrad and lazy Adam equal torch's optimizers run on one parameter per row; a
checkpoint restores into another number of ps and into a plain module for inference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tensorfleet.cluster.idhash import shard_of
from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.testing.models import run_workers, seeded_mlp
from tensorfleet.train.checkpoint import Checkpointer, load_into_module, load_tables
from tensorfleet.worker.embedding import EmbeddingTable
from tensorfleet.worker.replica import Replica

DIM, BATCH, STEPS = 4, 6, 12
# Ids are any int64: large, negative, sparse; a batch repeats some of them.
USERS = torch.tensor([7, -3, 2 ** 40 + 1, 0, 123456789, -(2 ** 62), 99, 5, 2 ** 62 + 17, 42])
TAGS = torch.tensor([11, 12, 13, -14, 2 ** 33, 16, 17])
USER_INIT, TAG_INIT = RowInitializer.normal(0.3, seed=1), RowInitializer.uniform(-0.2, 0.2, seed=2)
HEAD = seeded_mlp(2 * DIM, 5, 1, scale=0.3)


class TableModel(nn.Module):
    """A user table (one id per sample), a tags table (mean of a bag per sample), a dense head."""

    def __init__(self, table_optimizer: OptimizerSpec | None) -> None:
        super().__init__()
        self.user = EmbeddingTable("user", DIM, initializer=USER_INIT, optimizer=table_optimizer)
        self.tags = EmbeddingTable("tags", DIM, pooling="mean", initializer=TAG_INIT, optimizer=table_optimizer)
        self.head = copy.deepcopy(HEAD)

    def forward(self, users, tags, offsets):
        return self.head(torch.cat([self.user(users), self.tags(tags, offsets)], dim=1)).squeeze(1)


class ReferenceModel(nn.Module):
    """The same model with each table a full-size local parameter over the ids it will ever see."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Parameter(USER_INIT.rows(USERS, DIM))
        self.tags = nn.Parameter(TAG_INIT.rows(TAGS, DIM))
        self.head = copy.deepcopy(HEAD)

    def forward(self, users, tags, offsets):
        user_rows = self.user[_index(USERS, users)]
        tag_rows = nn.functional.embedding_bag(_index(TAGS, tags), self.tags, offsets, mode="mean")
        return self.head(torch.cat([user_rows, tag_rows], dim=1)).squeeze(1)


def _index(universe: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    position = {int(i): k for k, i in enumerate(universe.tolist())}
    return torch.tensor([position[int(i)] for i in ids.tolist()])


def batch_for(step: int, worker: int):
    g = torch.Generator().manual_seed(1000 * step + worker)
    users = USERS[torch.randint(0, len(USERS), (BATCH,), generator=g)]
    lengths = torch.randint(1, 4, (BATCH,), generator=g)
    tags = TAGS[torch.randint(0, len(TAGS), (int(lengths.sum()),), generator=g)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    return users, tags, offsets, torch.randn(BATCH, generator=g)


def union_batch(step: int, num_workers: int):
    parts = [batch_for(step, w) for w in range(num_workers)]
    shift = torch.tensor([0] + [len(p[1]) for p in parts]).cumsum(0)
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
            torch.cat([p[2] + shift[i] for i, p in enumerate(parts)]), torch.cat([p[3] for p in parts]))


def loss_of(model, batch):
    users, tags, offsets, y = batch
    return nn.functional.mse_loss(model(users, tags, offsets), y)


def rows_on_servers(servers, table: str) -> dict[int, torch.Tensor]:
    """Every row of ``table`` held by the ps, by id (each id on exactly one shard)."""
    rows = {}
    for server in servers:
        state = server.store.snapshot().tables[table]
        assert not set(state.ids.tolist()) & set(rows), "an id lives on two shards"
        rows.update(zip(state.ids.tolist(), state.values))
    return rows


@pytest.mark.parametrize("num_workers, overlap", [(2, False), (3, False), (2, True)])
def test_sync_with_tables_equals_one_process_with_the_union_batch(num_workers, overlap):
    lr_dense, lr_table = 0.1, 0.2
    reference = ReferenceModel()
    dense = torch.optim.SGD(reference.head.parameters(), lr=lr_dense)
    tables = torch.optim.Adagrad([reference.user, reference.tags], lr=lr_table)
    for step in range(STEPS):
        dense.zero_grad(), tables.zero_grad()
        loss_of(reference, union_batch(step, num_workers)).backward()
        dense.step(), tables.step()

    with ps_servers(num_ps=2, num_workers=num_workers) as (cluster, servers):
        def worker(index):
            model = TableModel(OptimizerSpec("adagrad", {"lr": lr_table}))
            with Replica(model, cluster, TaskSpec("worker", index), optimizer=OptimizerSpec.sgd(lr=lr_dense),
                         mode="sync", overlap=overlap) as replica:
                for step in range(STEPS):
                    assert replica.global_step == step
                    loss_of(model, batch_for(step, index)).backward()
                    replica.push()
                    replica.pull()
                return {n: p.detach().clone() for n, p in model.head.named_parameters()}

        finals = run_workers(num_workers, worker)
        assert all(s.store.status().global_step == STEPS for s in servers)
        for table, universe, expected in (("user", USERS, reference.user), ("tags", TAGS, reference.tags)):
            held = rows_on_servers(servers, table)
            for k, id_ in enumerate(universe.tolist()):
                if id_ in held:  # an id never in a batch was never created, and kept its initial row
                    torch.testing.assert_close(held[id_], expected[k].detach(), rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(expected[k].detach(), (USER_INIT if table == "user" else TAG_INIT).rows(
                        universe[k:k + 1], DIM)[0])
        assert {s.store.status().tables["user"].rows for s in servers} != {0}  # rows on both shards
    for name, expected in reference.head.named_parameters():
        for final in finals:
            torch.testing.assert_close(final[name], expected.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
def test_async_per_row_rules_equal_torch_on_one_parameter_per_row(rule):
    options = {"sgd": {"lr": 0.3}, "adagrad": {"lr": 0.2, "initial_accumulator_value": 0.1, "eps": 1e-8},
               "adam": {"lr": 0.05, "betas": [0.8, 0.95]}}[rule]
    torch_options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    optimizer_class = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[rule]
    reference = ReferenceModel()
    # One parameter per row, stepped only when its id was in the batch: the per-row rule, lazily.
    row_params = {(table, k): nn.Parameter(getattr(reference, table)[k].detach().clone())
                  for table, universe in (("user", USERS), ("tags", TAGS)) for k in range(len(universe))}
    row_optimizer = optimizer_class(list(row_params.values()), **torch_options)
    dense = torch.optim.SGD(reference.head.parameters(), lr=0.1)
    for step in range(STEPS):
        batch = batch_for(step, 0)
        with torch.no_grad():
            for (table, k), param in row_params.items():
                getattr(reference, table)[k] = param
        reference.zero_grad()
        loss_of(reference, batch).backward()
        touched = {("user", k) for k in _index(USERS, batch[0]).tolist()} | \
                  {("tags", k) for k in _index(TAGS, batch[1]).tolist()}
        for key, param in row_params.items():
            param.grad = getattr(reference, key[0]).grad[key[1]].clone() if key in touched else None
        row_optimizer.step()
        dense.step()

    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        model = TableModel(OptimizerSpec(rule, options))
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            for step in range(STEPS):
                loss_of(model, batch_for(step, 0)).backward()
                replica.push()
            assert replica.global_step == STEPS
            with torch.no_grad():  # a lookup through the model answers the ps's rows
                for table, universe in (("user", USERS), ("tags", TAGS)):
                    got = getattr(model, table)._rows(universe)
                    want = torch.stack([row_params[(table, k)].detach() for k in range(len(universe))])
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for name, expected in reference.head.named_parameters():
            torch.testing.assert_close(dict(model.head.named_parameters())[name].detach(), expected.detach(),
                                       rtol=1e-5, atol=1e-6)


def test_rows_live_on_the_shard_their_id_hashes_to_and_bytes_follow_unique_ids():
    with ps_servers(num_ps=3, num_workers=1) as (cluster, servers):
        model = TableModel(OptimizerSpec("sgd", {"lr": 0.1}))
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            loss_of(model, batch_for(0, 0)).backward()
            replica.push()
            assert replica.status.unique_ids == len(set(batch_for(0, 0)[0].tolist())) + \
                len(set(batch_for(0, 0)[1].tolist()))
        for index, server in enumerate(servers):
            for table in ("user", "tags"):
                ids = server.store.snapshot().tables[table].ids
                assert (shard_of(ids, 3) == index).all()
            status = server.status()
            assert status["tables"]["user"]["rows"] == len(server.store.snapshot().tables["user"].ids)


@pytest.mark.parametrize("overlap", [False, True], ids=["push", "streamed-push"])
def test_a_steps_ids_are_hashed_to_shards_once_on_the_worker(monkeypatch, overlap):
    """Each table's batch is made unique and routed to its shards in one pass; the lookup and the push of the row
    gradients reuse that routing (issue 30: the worker hashed the same ids twice per step; issue 39: one pass)."""
    import tensorfleet.worker.client as client_module

    hashed, real_pass = [], client_module.unique_by_shard
    monkeypatch.setattr(client_module, "shard_of", lambda ids, n: (hashed.append("hash"), shard_of(ids, n))[1])
    monkeypatch.setattr(client_module, "unique_by_shard", lambda flat, n: (hashed.append("pass"), real_pass(flat, n))[1])
    with ps_servers(num_ps=3, num_workers=1) as (cluster, servers):
        model = TableModel(OptimizerSpec("sgd", {"lr": 0.1}))
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1),
                     overlap=overlap) as replica:
            for step in range(2):
                hashed.clear()
                loss_of(model, batch_for(step, 0)).backward()
                replica.push()
                assert hashed == ["pass", "pass"], hashed  # one per table: user and tags
        for index, server in enumerate(servers):
            for table in ("user", "tags"):
                assert (shard_of(server.store.snapshot().tables[table].ids, 3) == index).all()


def test_checkpoint_restores_tables_into_another_number_of_ps_and_into_a_plain_module(tmp_path):
    spec = OptimizerSpec("adam", {"lr": 0.05})
    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        model = TableModel(spec)
        saver = Checkpointer(tmp_path)
        with saver.start(Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1))) \
                as replica:
            for step in range(STEPS):
                loss_of(model, batch_for(step, 0)).backward()
                replica.push()
            saver.save(replica)
            batch = batch_for(99, 0)
            with torch.no_grad():
                trained = model(*batch[:3])
        saved_user = rows_on_servers(servers, "user")
        saved_slots = {}
        for server in servers:
            state = server.store.snapshot().tables["tags"]
            saved_slots.update(zip(state.ids.tolist(), state.slots["exp_avg"]))

    with ps_servers(num_ps=3, num_workers=1) as (cluster, servers):
        model = TableModel(spec)
        with Checkpointer(tmp_path).start(Replica(model, cluster, TaskSpec("worker", 0),
                                                  optimizer=OptimizerSpec.sgd(lr=0.1))) as replica:
            assert replica.global_step == STEPS
            with torch.no_grad():
                torch.testing.assert_close(model(*batch[:3]), trained)
        restored = rows_on_servers(servers, "user")
        assert restored.keys() == saved_user.keys()
        assert all(torch.equal(restored[i], saved_user[i]) for i in restored)
        for index, server in enumerate(servers):  # every row moved to the shard its id hashes to among 3
            state = server.store.snapshot().tables["tags"]
            assert (shard_of(state.ids, 3) == index).all()
            assert all(torch.equal(slot, saved_slots[i]) for i, slot in zip(state.ids.tolist(), state.slots["exp_avg"]))

    plain = TableModel(spec)  # no cluster: the tables answer from the checkpoint's rows
    assert load_into_module(plain, tmp_path) == STEPS
    with torch.no_grad():
        torch.testing.assert_close(plain(*batch[:3]), trained)
    tables = load_tables(tmp_path)
    assert set(tables) == {"user", "tags"} and len(tables["user"].ids) == len(saved_user)


def test_a_table_used_twice_in_one_step_gets_one_summed_gradient():
    with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
        table = EmbeddingTable("shared", 3, optimizer=OptimizerSpec("sgd", {"lr": 1.0}),
                               initializer=RowInitializer.constant(0.0))
        holder = nn.ModuleDict({"table": table, "dense": nn.Linear(1, 1)})
        with Replica(holder, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.0)) as replica:
            (table(torch.tensor([5, 6, 5])).sum() + table(torch.tensor([[6], [9]])).sum()).backward()
            replica.push()
            with torch.no_grad():
                got = table(torch.tensor([5, 6, 9, 10]))
        # d(sum)/d(row) = occurrences: 5 twice, 6 twice, 9 once, 10 never; SGD lr 1 subtracts them
        torch.testing.assert_close(got, torch.tensor([[-2.0] * 3, [-2.0] * 3, [-1.0] * 3, [0.0] * 3]))


def test_prefetched_rows_of_several_tables_are_one_request_per_shard_and_the_same_training():
    def train(prefetch: bool):
        with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
            model = TableModel(OptimizerSpec("adagrad", {"lr": 0.2}))
            with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
                lookups = []
                for data in replica.client.data:
                    call = data.call
                    data.call = lambda method, *a, _call=call, **k: (lookups.append(method), _call(method, *a, **k))[1]
                for step in range(STEPS):
                    batch = batch_for(step, 0)
                    if prefetch:
                        replica.prefetch_rows({"user": batch[0], "tags": batch[1]})
                    loss_of(model, batch).backward()
                    replica.push()
            return rows_on_servers(servers, "user"), lookups.count("Lookup")

    (plain, plain_lookups), (prefetched, prefetched_lookups) = train(False), train(True)
    assert plain.keys() == prefetched.keys() and all(torch.equal(plain[i], prefetched[i]) for i in plain)
    assert prefetched_lookups <= STEPS * 2 < plain_lookups  # one per shard per step, not one per table and shard


def test_rows_travel_in_bf16_when_asked_and_train_like_fp32():
    def train(wire_dtype):
        with ps_servers(num_ps=2, num_workers=1) as (cluster, servers):
            model = TableModel(OptimizerSpec("adagrad", {"lr": 0.2}))
            with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1),
                         wire_dtype=wire_dtype) as replica:
                sent = []
                for data in replica.client.data:
                    call = data.call
                    data.call = lambda method, meta=None, tensors=None, *a, _call=call, **k: (
                        sent.extend(t.dtype for n, t in (tensors or {}).items() if n.startswith("@grads")),
                        _call(method, meta, tensors, *a, **k))[1]
                for step in range(STEPS):
                    loss_of(model, batch_for(step, 0)).backward()
                    replica.push()
                with torch.no_grad():
                    looked_up = model.user._rows(USERS)
            return rows_on_servers(servers, "user"), looked_up, set(sent)

    (full, _, full_sent), (narrow, narrow_lookup, narrow_sent) = train(None), train(torch.bfloat16)
    assert full_sent == {torch.float32} and narrow_sent == {torch.bfloat16}
    assert full.keys() == narrow.keys()
    for i in full:  # the ps keeps and updates fp32; only what travels is rounded
        assert narrow[i].dtype == torch.float32
        torch.testing.assert_close(narrow[i], full[i], rtol=0.05, atol=0.02)
    assert narrow_lookup.dtype == torch.float32  # the worker's rows are fp32 again (bf16 values)
    assert torch.equal(narrow_lookup, narrow_lookup.to(torch.bfloat16).float())


def test_a_table_used_after_its_replica_finished_says_where_the_rows_are(tmp_path):
    with ps_servers(num_ps=1, num_workers=1) as (cluster, servers):
        model = TableModel(OptimizerSpec("sgd", {"lr": 0.5}))
        saver = Checkpointer(tmp_path)
        with saver.start(Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1))) \
                as replica:
            loss_of(model, batch_for(0, 0)).backward()
            replica.push()
            saver.save(replica)
            with torch.no_grad():
                inside = model(*batch_for(1, 0)[:3])
    with pytest.raises(InvalidArgumentError, match="the Replica of /job:worker/task:0 has finished"):
        model(*batch_for(1, 0)[:3])  # not silently the initial rows
    load_into_module(model, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(*batch_for(1, 0)[:3]), inside)
