"""The worker side of a step with an embedding table, on a ``PsClient`` whose data channels are fakes (no socket).

Each fake shard answers a lookup with rows that name the shard that answered and the id (so a row routed to
the wrong shard, or landed at the wrong place, shows), receiving them into the caller's ``into`` tensors where
dtype and shape match, as ``DataChannel`` does, and records every lookup and push. The proofs: forward hands
``F.embedding``/``F.embedding_bag`` exactly each id's row from its own shard (ids of every shard interleaved,
duplicates, pooled or not, bf16 on the wire, bound as ``Replica`` binds or with a lookup alone); each shard is
pushed exactly its ids' summed gradients; a step makes each table's ids unique and routes them in one compiled
pass (no ``torch.unique``, no other hashing); the replies land in the very rows tensor forward uses, and the push
sends slices of that tensor's gradient, with one shard as with three.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from tensorfleet.cluster.idhash import shard_of
from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.protocol.messages import LookupRequest, Outcome, PushReply, StepReply, grads_key, ids_key
from tensorfleet.protocol.specs import OptimizerSpec, TableSpec
from tensorfleet.worker import client as client_module
from tensorfleet.worker.client import PsClient
from tensorfleet.worker.embedding import EmbeddingTable

DIM = 4
SGD = OptimizerSpec("sgd", {"lr": 0.1})
# Ids of every shard, interleaved, some repeated (large, negative, small).
IDS = torch.tensor([[5, 2 ** 40 + 3, -7, 5], [11, -7, 12, 13], [2 ** 40 + 3, 14, 15, 16]])


def answer(ids: torch.Tensor, shard: int) -> torch.Tensor:
    """The row a fake shard answers for each id: the id, the shard, and two values of the id (bf16-exact)."""
    rows = torch.empty((ids.numel(), DIM))
    rows[:, 0] = (ids % 256).float()
    rows[:, 1] = float(shard)
    rows[:, 2] = (ids % 7).float() / 4
    rows[:, 3] = -(ids % 5).float()
    return rows


def expected_rows(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Each id's row as the shard it hashes to answers it."""
    owner = torch.from_numpy(shard_of(ids, num_shards))
    return torch.stack([answer(i.view(1), int(s))[0] for i, s in zip(ids, owner)]) if ids.numel() else \
        torch.empty((0, DIM))


class FakeShard:
    """One shard's data channel: lookups answered (received into ``into`` where it fits), pushes recorded."""

    def __init__(self, index: int, num_shards: int) -> None:
        self.index, self.num_shards = index, num_shards
        self.lookups: list[tuple[dict, dict, dict]] = []  # (ids sent, into given, reply)
        self.pushes: list[dict[str, torch.Tensor]] = []

    def call(self, method, meta=None, tensors=None, *, into=None, timeout=None):
        tensors = dict(tensors or {})
        if method == "Lookup":
            wire = LookupRequest.from_meta(meta).wire_dtype
            reply = {}
            for table, ids in tensors.items():
                assert (shard_of(ids, self.num_shards) == self.index).all(), "an id sent to another shard"
                assert ids.unique().numel() == ids.numel(), "an id asked twice"
                value = answer(ids, self.index).to(wire or torch.float32)
                target = (into or {}).get(table)
                if target is None or target.dtype != value.dtype or target.shape != value.shape \
                        or not target.is_contiguous():
                    target = torch.empty_like(value)
                target.copy_(value)
                reply[table] = target
            self.lookups.append((tensors, dict(into or {}), reply))
            return StepReply(0).to_meta(), reply
        assert method == "Push", method
        self.pushes.append(tensors)
        return PushReply(1, Outcome.APPLIED).to_meta(), {}

    def close(self) -> None:
        pass


@pytest.fixture
def fleet():
    """``fleet(num_shards, wire_dtype=None)``: a PsClient on fake shards with tables "t" and "u" (dim 4)."""
    clients = []

    def make(num_shards: int, wire_dtype: torch.dtype | None = None) -> PsClient:
        cluster = ClusterSpec({"ps": [f"127.0.0.1:{1 + i}" for i in range(num_shards)], "worker": ["127.0.0.1:9"]})
        tables = [TableSpec("t", DIM, SGD), TableSpec("u", DIM, SGD)]
        client = PsClient(cluster, {}, wire_dtype=wire_dtype, tables=tables)
        client.data = [FakeShard(s, num_shards) for s in range(num_shards)]
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def bound(client: PsClient, name: str = "t", pooling: str | None = None, *, routed: bool = True) -> EmbeddingTable:
    """A table bound to ``client`` as ``Replica`` binds it; not ``routed``: with the lookup alone (its unique ids
    in first-seen order, routed by the lookup)."""
    table = EmbeddingTable(name, DIM, pooling=pooling, optimizer=SGD)
    table.bind(lambda ids: client.fetch({name: ids})[name],
               unique=(lambda flat: client.unique_by_shard(name, flat)) if routed else None)
    return table


def reference(ids: torch.Tensor, rows: torch.Tensor, pooling: str | None, offsets: torch.Tensor | None):
    """What the table's forward must give: nn.Embedding / EmbeddingBag over the unique ids' rows."""
    unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
    weight = rows.clone().requires_grad_(True)
    if pooling is None:
        return F.embedding(inverse.view(ids.shape), weight), unique, weight
    index = inverse if offsets is not None else inverse.view(ids.shape)
    return F.embedding_bag(index, weight, offsets, mode=pooling), unique, weight


CASES = [(None, IDS, None), ("sum", IDS, None), ("mean", IDS.reshape(-1), torch.tensor([0, 1, 6, 6, 9]))]


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("wire_dtype, routed", [(None, True), (torch.bfloat16, True), (None, False)],
                         ids=["fp32", "bf16-wire", "lookup-alone"])
@pytest.mark.parametrize("pooling, ids, offsets", CASES, ids=["no-pooling", "sum-2d", "mean-offsets"])
def test_forward_gives_each_id_the_row_its_own_shard_answered(fleet, num_shards, wire_dtype, routed, pooling, ids,
                                                             offsets):
    client = fleet(num_shards, wire_dtype)
    table = bound(client, pooling=pooling, routed=routed)
    got = table(ids, offsets) if offsets is not None else table(ids)
    unique = torch.unique(ids)
    want, _, _ = reference(ids, expected_rows(unique, num_shards), pooling, offsets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    asked = torch.cat([sent["t"] for shard in client.data for sent, _, _ in shard.lookups])
    assert sorted(asked.tolist()) == unique.tolist()  # each unique id asked once, of its own shard
    assert all(len(shard.lookups) == (1 if shard.lookups else 0) for shard in client.data)


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("routed", [True, False], ids=["routed", "lookup-alone"])
@pytest.mark.parametrize("pooling, ids, offsets", CASES, ids=["no-pooling", "sum-2d", "mean-offsets"])
def test_each_shard_is_pushed_exactly_its_ids_summed_gradients(fleet, num_shards, routed, pooling, ids, offsets):
    client = fleet(num_shards)
    table = bound(client, pooling=pooling, routed=routed)
    out = table(ids, offsets) if offsets is not None else table(ids)
    weights = torch.randint(-4, 5, out.shape, generator=torch.Generator().manual_seed(3)).float()
    (out * weights).sum().backward()
    client.push({}, rows={"t": table.take_gradients()})

    want_out, unique, weight = reference(ids, expected_rows(torch.unique(ids), num_shards), pooling, offsets)
    (want_out * weights).sum().backward()
    want = dict(zip(unique.tolist(), weight.grad))
    pushed = {}
    for index, shard in enumerate(client.data):
        (push,) = shard.pushes
        if ids_key("t") not in push:
            continue
        shard_ids, grads = push[ids_key("t")], push[grads_key("t")]
        assert (shard_of(shard_ids, num_shards) == index).all()
        assert grads.shape == (shard_ids.numel(), DIM)
        pushed.update(zip(shard_ids.tolist(), grads))
        assert len(pushed) == sum(len(s.pushes[0].get(ids_key("t"), ())) for s in client.data[:index + 1])
    assert sorted(pushed) == sorted(want)  # every unique id once, on its own shard
    for i in want:
        torch.testing.assert_close(pushed[i], want[i], rtol=0, atol=1e-6)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_the_replies_land_in_the_rows_forward_uses_and_the_push_sends_slices_of_their_gradient(fleet, num_shards):
    client = fleet(num_shards)
    table = bound(client, pooling="sum")
    table(IDS).sum().backward()
    lookups = [(sent, into, reply) for shard in client.data for sent, into, reply in shard.lookups]
    leaf = lookups[0][1].get("t", torch.empty(0))._base  # each shard's reply lands in a slice of one tensor
    assert leaf is not None and leaf.requires_grad and leaf.grad is not None  # the leaf backward filled
    landed = 0
    for sent, into, reply in lookups:
        assert "t" in into and reply["t"] is into["t"], "the reply was not received in place (a copy after it)"
        assert into["t"].untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr()
        assert into["t"].storage_offset() == landed * DIM  # the shards' runs, one after another
        landed += sent["t"].numel()
    assert landed == leaf.shape[0] == torch.unique(IDS).numel()
    client.push({}, rows={"t": table.take_gradients()})
    for shard in client.data:
        for name in (ids_key("t"), grads_key("t")):
            if name in shard.pushes[0]:  # slices of the step's tensors, not masked copies
                sent = shard.pushes[0][name]
                base = leaf.grad if name == grads_key("t") else lookups[0][0]["t"]
                assert sent.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), name


def test_a_step_makes_each_table_unique_and_routes_it_in_one_pass(fleet, monkeypatch):
    client = fleet(3)
    user, tags = bound(client, "t"), bound(client, "u", pooling="mean")
    calls = []
    real_unique, real_shard_of, real_pass = torch.unique, client_module.shard_of, client_module.unique_by_shard

    def unique(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("tensorfleet."):
            calls.append("unique")
        return real_unique(*args, **kwargs)

    monkeypatch.setattr(torch, "unique", unique)
    monkeypatch.setattr(client_module, "shard_of", lambda ids, n: (calls.append("hash"), real_shard_of(ids, n))[1])
    monkeypatch.setattr(client_module, "unique_by_shard", lambda flat, n: (calls.append("pass"), real_pass(flat, n))[1])
    for step in range(2):
        calls.clear()
        (user(IDS[:, :2] + step).sum() + tags(IDS + step).sum()).backward()
        client.push({}, rows={"t": user.take_gradients(), "u": tags.take_gradients()})
        assert calls == ["pass", "pass"], calls


def test_rows_in_any_order_are_looked_up_and_pushed_by_their_own_shard(fleet):
    """``lookup`` answers in the order asked; a push of (ids, gradients) that no lookup routed pairs them right."""
    client = fleet(3)
    ids = torch.tensor([16, 5, -7, 2 ** 40 + 3, 11, 14, 12, 13, 15])
    torch.testing.assert_close(client.lookup({"t": ids})["t"], expected_rows(ids, 3), rtol=0, atol=0)
    grads = torch.arange(ids.numel() * DIM, dtype=torch.float32).view(-1, DIM)
    client.push({}, rows={"t": (ids, grads)})
    pushed = {}
    for index, shard in enumerate(client.data):
        if ids_key("t") in shard.pushes[0]:
            assert (shard_of(shard.pushes[0][ids_key("t")], 3) == index).all()
            pushed.update(zip(shard.pushes[0][ids_key("t")].tolist(), shard.pushes[0][grads_key("t")]))
    assert sorted(pushed) == sorted(ids.tolist())
    assert all(torch.equal(pushed[int(i)], g) for i, g in zip(ids, grads))
