"""Rows that come and go: admission, TTL and capacity eviction, the memory budget, their checkpoints and counts.

On the ps's own objects (``EmbeddingShard``, ``VariableStore``), no sockets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.ps.admission import Admission
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer, TableSpec
from tensorfleet.protocol.messages import Origin, grads_key, ids_key
from tensorfleet.ps.store import VariableStore
from tensorfleet.ps.table import LAST_UPDATE, EmbeddingShard

SGD = OptimizerSpec("sgd", {"lr": 1.0})
ZERO = RowInitializer("constant", 0.0)


def table(**options) -> EmbeddingShard:
    return EmbeddingShard(TableSpec("t", 2, SGD, initializer=options.pop("initializer", ZERO), **options))


def push(shard: EmbeddingShard, ids: list[int], update: int, grad: float = 1.0) -> None:
    shard.apply(torch.tensor(ids, dtype=torch.int64), torch.full((len(ids), 2), grad), 1.0, update)
    shard.sweep(update)


def value(shard: EmbeddingShard, id_: int) -> float:
    return float(shard.lookup(torch.tensor([id_]))[0, 0])


# ----- admission


def test_an_id_gets_a_row_on_its_nth_push_and_its_earlier_gradients_are_dropped_and_counted():
    shard = table(admit_after=3)
    push(shard, [7], 0)
    push(shard, [7], 1)
    assert len(shard) == 0 and value(shard, 7) == 0.0  # the initial row, untrained
    push(shard, [7, 8], 2)
    assert len(shard) == 1 and value(shard, 7) == -1.0  # admitted: this push's gradient only
    status = shard.status()
    assert (status.admitted, status.refused_updates) == (1, 3)  # 7 twice, then 8 once


def test_probability_admission_is_about_p_and_the_same_for_the_same_push():
    ids = np.arange(20_000, dtype=np.int64)
    first = Admission(probability=0.25).admit(ids, update=5)
    again = Admission(probability=0.25).admit(ids, update=5)
    assert 0.23 < first.mean() < 0.27 and (first == again).all()
    assert (Admission(probability=0.25).admit(ids, update=6) != first).any()  # a later push: another chance


def test_the_admission_counts_take_a_fixed_memory_whatever_the_number_of_candidates():
    admission = Admission(after=5)
    before = admission.nbytes
    for start in range(0, 400_000, 100_000):
        admission.admit(np.arange(start, start + 100_000, dtype=np.int64), update=start)
    assert admission.nbytes == before == 4 * 65536 * 2
    frequent = np.array([123_456_789], dtype=np.int64)
    admitted_at = [bool(admission.admit(frequent, u)[0]) for u in range(5)]
    assert admitted_at[-1] and not admitted_at[0]  # a crowded sketch may admit early, never late


def test_a_sketch_with_room_counts_exactly():
    admission = Admission(after=4)
    admission.admit(np.arange(5_000, dtype=np.int64), update=0)
    ids = np.array([5, 77, 4_999], dtype=np.int64)
    assert [admission.admit(ids, u).tolist() for u in range(1, 4)] == [[False] * 3, [False] * 3, [True] * 3]


# ----- eviction


def test_rows_not_updated_for_ttl_steps_are_evicted_and_come_back_fresh():
    shard = table(ttl_steps=8)
    push(shard, [1, 2], 0)
    for update in range(1, 20):
        push(shard, [1], update)  # 1 stays fresh, 2 is never touched again
    assert len(shard) == 1 and shard.status().evicted == 1
    assert value(shard, 2) == 0.0  # back to its initial row
    assert value(shard, 1) == -20.0  # every one of its updates, none lost
    push(shard, [2], 20)
    assert value(shard, 2) == -1.0


def test_a_capacity_keeps_the_most_recently_updated_rows_and_their_values():
    shard = table(max_rows=100)
    expected: dict[int, float] = {}
    for update in range(300):
        hot, cold = update % 10, 1000 + update  # ten hot ids every step, one new cold id each step
        push(shard, [hot, cold], update)
        expected[hot] = expected.get(hot, 0.0) - 1.0
        assert len(shard) <= 100
    for hot in range(10):
        assert value(shard, hot) == expected[hot]  # never evicted, every update there once
    recent = [1000 + u for u in range(290, 300)]
    assert all(value(shard, i) == -1.0 for i in recent)
    assert value(shard, 1000) == 0.0  # the oldest cold row went
    assert shard.status().evicted == 300 + 10 - len(shard)


def test_eviction_never_takes_the_rows_of_the_push_being_applied():
    shard = table(max_rows=4)
    push(shard, [1, 2, 3, 4], 0)
    push(shard, [1, 5], 1)  # needs room for 5: 1 is in this push, so 2, 3 or 4 go
    assert value(shard, 1) == -2.0 and value(shard, 5) == -1.0 and len(shard) <= 4


def test_a_checkpoint_of_an_evicting_table_restores_its_rows_and_their_ages():
    shard = table(ttl_steps=10)
    push(shard, [1, 2, 3], 0)
    push(shard, [1], 6)
    state = shard.state()
    assert state.slots[LAST_UPDATE].tolist() == [6, 0, 0]
    restored = table(ttl_steps=10)
    restored.load(state, update=6)
    push(restored, [], 12)  # 2 and 3 are now 12 updates old, 1 only 6
    assert sorted(restored.state().ids.tolist()) == [1] and value(restored, 1) == -2.0


def test_rows_of_a_checkpoint_without_ages_count_as_updated_at_the_restore():
    saved = table().state()
    shard = table()
    push(shard, [4, 5], 0)
    old = shard.state()
    old.slots.pop(LAST_UPDATE)
    restored = table(ttl_steps=5)
    restored.load(old, update=100)
    push(restored, [], 103)
    assert len(restored) == 2 and saved.ids.numel() == 0


@pytest.mark.parametrize("options, words", [
    ({"admit_after": 0}, "admit_after=0 must be an integer of at least 1"),
    ({"admit_probability": 0.0}, "admit_probability=0.0 must be in (0, 1]"),
    ({"ttl_steps": -1}, "ttl_steps=-1 must be an integer of at least 1"),
    ({"max_rows": 2.5}, "max_rows=2.5 must be an integer"),
    ({"max_rows": 10, "num_rows": 100}, "admission and eviction are for growing tables")])
def test_bad_lifecycle_settings_are_refused(options, words):
    with pytest.raises(InvalidArgumentError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        TableSpec("t", 2, SGD, **options)


def test_the_settings_travel_to_the_ps_and_back():
    spec = TableSpec("t", 2, SGD, admit_after=3, admit_probability=0.1, ttl_steps=100, max_rows=5000)
    assert TableSpec.from_meta(spec.to_meta()) == spec


# ----- the ps's memory budget, through the store


def budget_store(budget: int) -> VariableStore:
    store = VariableStore(task="/job:ps/task:0", memory_budget=budget)
    store.initialize({}, OptimizerSpec("sgd", {"lr": 1.0}), tables=[
        TableSpec("a", 16, SGD, initializer=ZERO), TableSpec("b", 4, SGD, initializer=ZERO)])
    return store


def test_the_tables_stay_within_the_memory_budget_and_recent_rows_stay():
    budget = 2 << 20
    store = budget_store(budget)
    for step in range(120):
        ids = torch.arange(step * 500, (step + 1) * 500, dtype=torch.int64)  # 500 new ids per table per step
        store.apply({ids_key("a"): ids, grads_key("a"): torch.ones(500, 16),
                     ids_key("b"): ids, grads_key("b"): torch.ones(500, 4)}, advance_step=True,
                    origin=Origin(0, 0, step + 1))
        tables = store.status().tables
        assert tables["a"].bytes + tables["b"].bytes <= budget
    tables = store.status().tables
    assert tables["a"].evicted > 0 and tables["b"].evicted > 0
    rows, _ = store.lookup({"a": torch.tensor([119 * 500, 0])})
    assert rows["a"][0, 0] == -1.0 and rows["a"][1, 0] == 0.0  # the newest row is there, the oldest went


def test_a_push_whose_rows_cannot_fit_the_budget_is_refused_and_changes_nothing():
    """Issue 28, item 8: one push of 400k new ids left a ps at 4x a 64 MiB budget (a push's own rows are never
    evicted). A push that cannot fit with every other row evicted is refused before it changes anything."""
    budget = 2 << 20
    store = budget_store(budget)
    store.apply({ids_key("a"): torch.arange(100), grads_key("a"): torch.ones(100, 16)}, advance_step=True)
    before = store.status()
    many = torch.arange(1000, 1000 + 40_000)  # ~4 MiB of rows of "a" alone
    with pytest.raises(InvalidArgumentError, match="over this ps's memory budget of 2.0 MiB: push fewer unique ids"):
        store.apply({ids_key("a"): many, grads_key("a"): torch.ones(40_000, 16)}, advance_step=True,
                    origin=Origin(0, 0, 1))
    after = store.status()
    assert (after.applied_updates, after.global_step, after.tables["a"].rows) == (
        before.applied_updates, before.global_step, 100)
    assert after.accepted_pushes == before.accepted_pushes  # refused, not taken: a resend is refused alike
    store.apply({ids_key("a"): many[:2000], grads_key("a"): torch.ones(2000, 16)}, advance_step=True,
                origin=Origin(0, 0, 1))
    assert store.status().tables["a"].rows == 2100


def test_the_log_of_evicted_ids_counts_within_the_budget():
    """Issue 28, item 8: the eviction log (up to 10M ids per table) was outside the budget: a 16 MiB budget held
    229 MiB more. It counts in a table's bytes now, and keeps at most a tenth of the budget."""
    budget = 1 << 20
    store = budget_store(budget)
    for step in range(300):
        ids = torch.arange(step * 2000, (step + 1) * 2000, dtype=torch.int64)  # every step evicts thousands
        store.apply({ids_key("b"): ids, grads_key("b"): torch.ones(2000, 4)}, advance_step=True,
                    origin=Origin(0, 0, step + 1))
        tables = store.status().tables
        assert tables["a"].bytes + tables["b"].bytes <= budget
    shard = store._tables["b"]
    kept = sum(ids.nbytes for _, ids in shard._evictions)  # what the log really holds
    assert shard.evicted > 500_000 and kept == shard.log_bytes <= 0.1 * budget
    assert store.snapshot(since=1).since is None  # the oldest evictions were forgotten: the save is whole


def test_a_budget_below_the_tables_floor_is_said_at_start_up(caplog):
    store = VariableStore(task="/job:ps/task:0", memory_budget=64 << 10)
    store.initialize({}, OptimizerSpec("sgd", {"lr": 1.0}), tables=[TableSpec("a", 64, SGD, initializer=ZERO)])
    said = [r.getMessage() for r in caplog.records if "below what its 1 table(s) need" in r.getMessage()]
    assert len(said) == 1 and "raise --ps_memory_budget" in said[0], said
    caplog.clear()
    budget_store(64 << 20)  # plenty: nothing said
    assert not [r for r in caplog.records if "memory budget" in r.getMessage()]


def test_nothing_can_be_evicted_is_said_once_not_at_every_update(caplog):
    """Issue 42: a budget below the tables' floor logged "nothing can be evicted" at every update."""
    store = VariableStore(task="/job:ps/task:0", memory_budget=64 << 10)
    store.initialize({}, OptimizerSpec("sgd", {"lr": 1.0}), tables=[TableSpec("a", 64, SGD, initializer=ZERO)])
    for step in range(20):
        store.apply({ids_key("a"): torch.tensor([7]), grads_key("a"): torch.ones(1, 64)}, advance_step=True,
                    origin=Origin(0, 0, step + 1))
    said = [r.getMessage() for r in caplog.records if "nothing can be evicted" in r.getMessage()]
    assert len(said) == 1 and "said once" in said[0], said
    assert store._budget.stuck_updates == 20


def test_a_resent_push_neither_counts_towards_admission_twice_nor_applies_twice():
    store = VariableStore(task="/job:ps/task:0")
    store.initialize({}, OptimizerSpec("sgd", {"lr": 1.0}), tables=[
        TableSpec("a", 2, SGD, initializer=ZERO, admit_after=2)])
    one = {ids_key("a"): torch.tensor([9]), grads_key("a"): torch.ones(1, 2)}
    store.apply(one, advance_step=True, origin=Origin(0, 0, 1))
    store.apply(one, advance_step=True, origin=Origin(0, 0, 1))  # its reply was lost: sent again
    assert store.status().tables["a"].rows == 0  # counted once: not yet admitted
    store.apply(one, advance_step=True, origin=Origin(0, 0, 2))
    rows, _ = store.lookup({"a": torch.tensor([9])})
    assert store.status().tables["a"].rows == 1 and rows["a"][0, 0] == -1.0


def test_the_memory_budget_flag_takes_sizes_and_names_a_bad_one():
    import argparse

    from tensorfleet.cluster.flags import add_cluster_flags, memory_budget_from_flags
    from tensorfleet.cluster.spec import ClusterSpecError
    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    assert memory_budget_from_flags(parser.parse_args(["--ps_memory_budget", "1.5GiB"]), {}) == 3 * 2 ** 29
    assert memory_budget_from_flags(parser.parse_args([]), {"TENSORFLEET_PS_MEMORY_BUDGET": "500MB"}) == 5 * 10 ** 8
    assert memory_budget_from_flags(parser.parse_args([]), {}) is None
    with pytest.raises(ClusterSpecError, match="--ps_memory_budget='lots' is not a size"):
        memory_budget_from_flags(parser.parse_args(["--ps_memory_budget", "lots"]), {})


# ----- what a delta checkpoint is made of


def test_a_delta_holds_the_rows_changed_and_the_ids_evicted_since_an_update():
    shard = table(max_rows=4)
    push(shard, [1, 2, 3, 4], 0)
    push(shard, [1], 5)
    push(shard, [9, 1], 6)  # room for 9: the oldest rows go
    rows, evicted = shard.delta_state(5)
    assert sorted(rows.ids.tolist()) == [1, 9] and rows.slots[LAST_UPDATE].tolist() == [6, 6]
    assert set(evicted.tolist()) <= {2, 3, 4} and len(shard) + evicted.numel() == 5


def test_a_delta_from_before_the_kept_evictions_is_refused_and_the_store_saves_whole(monkeypatch):
    import tensorfleet.ps.table as table_module
    monkeypatch.setattr(table_module, "EVICTION_LOG_IDS", 3)
    store = VariableStore(task="/job:ps/task:0")
    store.initialize({}, OptimizerSpec("sgd", {"lr": 1.0}), tables=[TableSpec("a", 2, SGD, initializer=ZERO,
                                                                              max_rows=2)])
    for step in range(6):  # every push evicts: the log keeps the latest evictions only
        store.apply({ids_key("a"): torch.tensor([10 * step, 10 * step + 1]), grads_key("a"): torch.ones(2, 2)},
                    advance_step=True, origin=Origin(0, 0, step + 1))
    assert store.snapshot(since=1).since is None  # evictions of update 1 are forgotten: whole
    recent = store.snapshot(since=5)
    assert recent.since == 5 and recent.tables["a"].ids.numel() == 2 and recent.evicted["a"].numel() == 2


def test_a_delta_that_comes_back_whole_is_paged_as_a_whole(monkeypatch):
    """Its page count is that of every row, not of the few the delta would have held."""
    import tensorfleet.ps.store as store_module
    import tensorfleet.ps.table as table_module
    monkeypatch.setattr(table_module, "EVICTION_LOG_IDS", 3)
    monkeypatch.setattr(store_module, "SNAPSHOT_PAGE_BYTES", 4 * 24)  # 4 rows of width 2 (+ update, + id)
    store = VariableStore(task="/job:ps/task:0")
    store.initialize({}, OptimizerSpec("sgd", {"lr": 1.0}), tables=[
        TableSpec("a", 2, SGD, initializer=ZERO, max_rows=2), TableSpec("b", 2, SGD, initializer=ZERO)])
    store.apply({ids_key("b"): torch.arange(10), grads_key("b"): torch.ones(10, 2)}, advance_step=True,
                origin=Origin(0, 0, 1))  # rows that no delta since update 2 holds
    for step in range(1, 7):  # every push to "a" evicts: the log keeps the latest evictions only
        store.apply({ids_key("a"): torch.tensor([10 * step, 10 * step + 1]), grads_key("a"): torch.ones(2, 2)},
                    advance_step=True, origin=Origin(0, 0, step + 1))
    first = store.snapshot(since=2)
    assert first.since is None and first.pages == 3  # 12 rows whole; the delta's 2 rows would be 1 page
    pages = [first] + [store.snapshot(since=2, page=p, pages=first.pages) for p in range(1, first.pages)]
    assert sorted(i for page in pages for i in page.tables["b"].ids.tolist()) == list(range(10))
    assert sum(page.tables["a"].ids.numel() for page in pages) == 2


@pytest.mark.parametrize("path", ["numpy", "numba"])
def test_lazy_adam_equals_torch_adam_on_one_parameter_per_row_to_the_bit(monkeypatch, path):
    """Issue 30, item 4: the bias corrections were computed in float32 (rows drifted 2.5e-6 from torch.optim.Adam
    after 12 steps); torch computes them in float64 and rounds the step size once, as the rows do now. The
    torch path (the reference) to the bit; the compiled kernel (issue 27) within a float32 rounding, as torch's
    float32 sqrt (MKL's) is not the correctly rounded one the kernel takes, in about 1 case of 6."""
    monkeypatch.setenv("TENSORFLEET_PS_KERNELS", path)
    options = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-8}
    shard = EmbeddingShard(TableSpec("t", 4, OptimizerSpec("adam", {**options, "betas": [0.8, 0.95]}),
                                     initializer=ZERO))
    rng = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(6)]
    reference = torch.optim.Adam(params, foreach=False, **options)
    for update in range(40):
        touched = torch.nonzero(torch.rand(6, generator=rng) < 0.6).flatten()  # rows stepped only when touched
        if not touched.numel():
            continue
        grads = torch.randn(touched.numel(), 4, generator=rng)
        for index, param in enumerate(params):
            hit = (touched == index).nonzero()
            param.grad = grads[hit[0, 0]].clone() if hit.numel() else None
        reference.step()
        shard.apply(touched.to(torch.int64), grads, options["lr"], update)
    rows, want = shard.lookup(torch.arange(6)), torch.stack([p.detach() for p in params])
    if path == "numpy":
        assert torch.equal(rows, want), (rows - want).abs().max()
    else:
        torch.testing.assert_close(rows, want, rtol=1e-6, atol=1e-7)
