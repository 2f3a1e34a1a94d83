"""The worker's one compiled pass over a table's batch (``worker/routing.py``) against the path it replaces:
``torch.unique`` + ``Route.of`` + the inverse mapped through ``position`` (issue 39).

The pass puts each shard's ids in the order the batch first names them, the old path in ascending order: the
two are compared after sorting within each shard's run (the rest must be equal to the element). The shard of
every id is ``cluster.idhash.shard_of``'s to the bit (both ends must agree), extremes of int64 included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorfleet.cluster.idhash import shard_of
from tensorfleet.worker import routing
from tensorfleet.worker.client import Route
from tensorfleet.worker.embedding import EmbeddingTable, Fetched, first_seen_unique
from tensorfleet.protocol.specs import OptimizerSpec

EXTREMES = [0, -1, 1, 2 ** 63 - 1, -2 ** 63, 2 ** 62, -2 ** 62, 2 ** 32, -2 ** 32]
SHARDS = [1, 2, 3, 4, 7, 64, 1000]


def today(flat: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """What a step did before the pass: ``torch.unique``, ``Route.of`` of its ids, the inverse mapped through
    ``position``."""
    unique, inverse = torch.unique(flat, return_inverse=True)
    route = Route.of(unique, num_shards)
    if route.position is not None:
        inverse = route.position.index_select(0, inverse)
    return route.ids, route.spans, inverse


def sorted_within_shards(unique: torch.Tensor, spans: tuple, inverse: torch.Tensor) -> tuple:
    """The same result with each shard's run in ascending order (the inverse map following)."""
    order = torch.arange(unique.numel())
    for _, start, end in spans:
        order[start:end] = start + torch.argsort(unique[start:end])
    where = torch.empty_like(order)
    where[order] = torch.arange(order.numel())
    return unique[order], spans, where[inverse]


def batches(seed: int) -> list[torch.Tensor]:
    """Batches with duplicates (Zipf-like and uniform), negatives, int64's extremes, one id, none."""
    rng = np.random.default_rng(seed)
    zipf = np.minimum(rng.zipf(1.2, size=5000), 10_000_000) - 1
    wide = rng.integers(-2 ** 63, 2 ** 63 - 1, size=3000, dtype=np.int64)
    mixed = np.concatenate([EXTREMES * 3, rng.choice(wide, 500), rng.integers(-50, 50, size=700)])
    rng.shuffle(mixed)
    return [torch.from_numpy(array.astype(np.int64)) for array in
            (zipf, rng.integers(0, 10_000_000, size=32768), wide, mixed, np.array([7]), np.array([], np.int64))]


@pytest.mark.parametrize("num_shards", SHARDS)
@pytest.mark.parametrize("seed", range(2))
def test_the_pass_gives_what_unique_route_and_position_gave(seed, num_shards):
    for flat in batches(seed):
        unique, spans, inverse = routing.unique_by_shard(flat, num_shards)
        assert unique.dtype == inverse.dtype == torch.int64 and inverse.shape == flat.shape
        assert torch.equal(unique[inverse], flat)  # every position finds its own id
        got = sorted_within_shards(unique, spans, inverse)
        want = today(flat, num_shards)
        assert torch.equal(got[0], want[0]) and got[1] == want[1] and torch.equal(got[2], want[2])
        reference = routing.reference_unique_by_shard(flat, num_shards)  # the path without numba
        assert torch.equal(reference[0], want[0]) and reference[1] == want[1] and torch.equal(reference[2], want[2])


@pytest.mark.parametrize("num_shards", SHARDS)
def test_each_id_goes_to_the_shard_that_shard_of_names_to_the_bit(num_shards):
    rng = np.random.default_rng(num_shards)
    flat = torch.from_numpy(np.concatenate([np.array(EXTREMES, np.int64),
                                            rng.integers(-2 ** 63, 2 ** 63 - 1, size=20000, dtype=np.int64)]))
    unique, spans, _ = routing.unique_by_shard(flat, num_shards)
    shard = np.empty(unique.numel(), dtype=np.int64)
    for owner, start, end in spans:
        shard[start:end] = owner
    assert np.array_equal(shard, shard_of(unique, num_shards))
    assert [owner for owner, _, _ in spans] == sorted({owner for owner, _, _ in spans})  # runs in shard order
    assert all(start < end for _, start, end in spans) and (spans[-1][2] if spans else 0) == unique.numel()


def test_each_shards_ids_come_in_the_order_the_batch_first_names_them():
    flat = torch.tensor([9, 4, 9, -3, 4, 2 ** 63 - 1, 8, -3, 0, 5, 8])
    for num_shards in (1, 3):
        unique, spans, _ = routing.unique_by_shard(flat, num_shards)
        first = {int(i): flat.tolist().index(int(i)) for i in unique}
        for _, start, end in spans:
            run = [first[int(i)] for i in unique[start:end]]
            assert run == sorted(run)
    assert first_seen_unique(flat)[0].tolist() == [9, 4, -3, 2 ** 63 - 1, 8, 0, 5]


def test_the_pass_takes_int32_ids_and_refuses_no_shards():
    unique, spans, inverse = routing.unique_by_shard(torch.tensor([3, 1, 3], dtype=torch.int32), 2)
    assert unique.dtype == torch.int64 and torch.equal(unique[inverse], torch.tensor([3, 1, 3]))
    with pytest.raises(ValueError, match="at least one shard"):
        routing.unique_by_shard(torch.tensor([1]), 0)


def test_the_pass_releases_the_gil():
    """The shards' threads receive the next step's rows while a step's ids are routed."""
    from tensorfleet.worker.routing_kernel import unique_by_shard_kernel

    assert unique_by_shard_kernel.targetoptions["nogil"] is True


@pytest.mark.parametrize("why", ["no numba", "too many ids"])
def test_without_numba_or_past_max_ids_the_reference_path_answers(monkeypatch, why):
    flat = batches(5)[3]
    monkeypatch.setattr(routing, *(("COMPILED", False) if why == "no numba" else ("MAX_IDS", flat.numel() - 1)))
    monkeypatch.setattr(routing, "_kernel", None)  # not called
    got = routing.unique_by_shard(flat, 3)
    want = today(flat, 3)
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and torch.equal(got[2], want[2])


def test_prefetched_rows_serve_a_forward_of_the_same_ids_in_another_order():
    """``expect`` announced the batch's unique ids in one order; a forward naming them in another order takes
    the prefetched rows (no lookup), each id its own row."""
    looked_up = []

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        looked_up.append(ids)
        return ids.to(torch.float32).view(-1, 1).repeat(1, 2)

    table = EmbeddingTable("t", 2, optimizer=OptimizerSpec("sgd", {"lr": 0.1}))
    table.bind(lookup)
    flat = torch.tensor([5, -7, 5, 2 ** 40, 11])
    unique, inverse = first_seen_unique(flat)
    rows = lookup(unique)  # on their way
    looked_up.clear()
    table.expect(flat, unique, inverse, lambda: Fetched(unique, rows))
    shuffled = torch.tensor([[11, 2 ** 40], [5, -7]])
    out = table(shuffled)
    assert looked_up == []  # the prefetched rows served
    assert torch.equal(out, shuffled.to(torch.float32).unsqueeze(-1).repeat(1, 1, 2))
    table(torch.tensor([5, 6]))  # other ids: looked up
    assert [ids.tolist() for ids in looked_up] == [[5, 6]]
