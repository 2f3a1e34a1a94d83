"""The worker side of a step with embedding tables, on real ps servers (3 shards, in this process).

A step (forward of each table once, backward, push; with ``prefetch_rows``, with the push streamed during
backward, with prefetch) makes each table's ids unique and routes them to shards in one compiled pass (no
``torch.unique``, no other hashing), and trains as the plain step does; each shard's lookup reply is received by the data channel straight into the rows tensor
forward hands to autograd, and the push sends slices of that tensor's gradient.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from tensorfleet.cluster.idhash import shard_of
from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.protocol.messages import grads_key
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.worker import client as client_module
from tensorfleet.worker.embedding import EmbeddingTable
from tensorfleet.worker.replica import Replica

STEPS = 4


class Tables(nn.Module):
    """A user table (one id per sample) and a tags table (a sum of 3 per sample), then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        rule = OptimizerSpec("adagrad", {"lr": 0.3})
        self.user = EmbeddingTable("user", 4, optimizer=rule, initializer=RowInitializer.normal(0.3, seed=1))
        self.tags = EmbeddingTable("tags", 4, pooling="sum", optimizer=rule,
                                   initializer=RowInitializer.normal(0.3, seed=2))
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.head.weight.fill_(0.5)
            self.head.bias.zero_()

    def forward(self, users, tags):
        return self.head(torch.cat([self.user(users), self.tags(tags)], 1)).squeeze(1)


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    users = torch.randint(-50, 50, (16,), generator=g) * 7919  # duplicates, negative, on every shard
    return users, torch.randint(0, 40, (16, 3), generator=g), torch.randn(16, generator=g)


def counting(monkeypatch) -> list[str]:
    """``torch.unique`` run by the worker's code, ``shard_of`` and the compiled pass run by the client, from now on."""
    calls: list[str] = []
    real_unique, real_shard_of, real_pass = torch.unique, client_module.shard_of, client_module.unique_by_shard

    def unique(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("tensorfleet.worker"):  # not the ps's
            calls.append("unique")
        return real_unique(*args, **kwargs)

    monkeypatch.setattr(torch, "unique", unique)
    monkeypatch.setattr(client_module, "shard_of", lambda ids, n: (calls.append("hash"), real_shard_of(ids, n))[1])
    monkeypatch.setattr(client_module, "unique_by_shard", lambda flat, n: (calls.append("pass"), real_pass(flat, n))[1])
    return calls


def train(way: str, calls: list[str] | None = None) -> dict[str, dict[int, torch.Tensor]]:
    """STEPS steps of one worker, ``way``: "plain", "prefetch_rows", "overlap" or "prefetch"; the rows after."""
    with ps_servers(num_ps=3, num_workers=1) as (cluster, servers):
        model = Tables()
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1),
                     overlap=way == "overlap", prefetch=way == "prefetch") as replica:
            for step in range(STEPS):
                users, tags, y = batch(step)
                if calls is not None:
                    calls.clear()
                if way == "prefetch_rows":
                    replica.prefetch_rows({"user": users, model.tags: tags})
                nn.functional.mse_loss(model(users, tags), y).backward()
                replica.push()
                if calls is not None:
                    assert calls == ["pass", "pass"], (step, calls)  # one per table
        rows: dict[str, dict[int, torch.Tensor]] = {"user": {}, "tags": {}}
        for index, server in enumerate(servers):
            for name in rows:
                state = server.store.snapshot().tables[name]
                assert (shard_of(state.ids, 3) == index).all()
                rows[name].update(zip(state.ids.tolist(), state.values))
        return rows


@pytest.mark.parametrize("way", ["plain", "prefetch_rows", "overlap", "prefetch"])
def test_a_step_makes_each_tables_ids_unique_and_routes_them_in_one_pass(monkeypatch, way):
    trained = train(way, counting(monkeypatch))
    if way in ("prefetch_rows", "overlap"):  # the same training as the plain step (prefetch computes on older rows)
        monkeypatch.undo()
        plain = train("plain")
        for name in plain:
            assert trained[name].keys() == plain[name].keys()
            assert all(torch.equal(trained[name][i], plain[name][i]) for i in plain[name]), name


def test_the_lookup_replies_land_in_the_rows_backward_fills_and_the_push_sends_slices_of_its_gradient():
    with ps_servers(num_ps=3, num_workers=1) as (cluster, _):
        model = Tables()
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            seen: list[tuple[str, dict, dict, dict]] = []
            for data in replica.client.data:
                def call(method, meta=None, tensors=None, *args, _call=data.call, into=None, **kwargs):
                    reply = _call(method, meta, tensors, *args, into=into, **kwargs)
                    seen.append((method, dict(tensors or {}), dict(into or {}), reply[1]))
                    return reply
                data.call = call
            users, tags, y = batch(0)
            nn.functional.mse_loss(model(users, tags), y).backward()
            lookups = [(into, reply) for method, _, into, reply in seen if method == "Lookup"]
            assert len(lookups) == 6  # each table asks each shard
            leaves = {}
            for into, reply in lookups:
                (name,) = reply
                assert reply[name] is into[name], name  # received in place by the data channel
                leaf = leaves.setdefault(name, into[name]._base)
                assert into[name]._base is leaf, name  # every shard's slice of one tensor
            for name, leaf in leaves.items():
                assert leaf.grad is not None and leaf.shape[0] == sum(into[name].shape[0] for into, r in lookups
                                                                       if name in r), name
            seen.clear()
            replica.push()
            pushes = [tensors for method, tensors, _, _ in seen if method == "Push"]
            assert len(pushes) == 3
            for name, leaf in leaves.items():
                for tensors in pushes:
                    grads = tensors[grads_key(name)]
                    assert grads.untyped_storage().data_ptr() == leaf.grad.untyped_storage().data_ptr(), name
