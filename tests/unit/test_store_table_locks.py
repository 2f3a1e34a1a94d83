"""No global lock across tables (issue 27, item 2): a push or lookup's parts on several tables (and the dense
variables) run at the same time, each table at its own turn; pushes stay exactly-once and a lookup or snapshot
never sees a push on one table and not on another, under concurrent pushes and resent ones.

Every push here is sgd with lr 1 and gradients of ones, so a row (or the dense ``x``) holds minus the number of
pushes applied to it: a half-applied push shows as two tables that disagree."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tensorfleet.protocol.messages import Origin, grads_key, ids_key
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer, TableSpec
from tensorfleet.ps.apply import Applier
from tensorfleet.ps.store import VariableStore
from tensorfleet.ps.table import EmbeddingShard
from tensorfleet.ps.tablelocks import TableTurns

SGD = OptimizerSpec.sgd(lr=1.0)
ZERO = RowInitializer.constant(0.0)
INCARNATION = time.time_ns()
IDS = torch.arange(64)
DIM = 8
TIMEOUT_S = 30.0  # joins: a hang fails the test instead of the run


def store_with(*specs: TableSpec, replicas: int = 4) -> VariableStore:
    store = VariableStore(task="/job:ps/task:0", replica_names=[f"/job:worker/task:{i}" for i in range(replicas)])
    store.initialize({"x": torch.zeros(4)}, SGD, tables=list(specs))
    return store


def tables(*names: str) -> list[TableSpec]:
    return [TableSpec(name, DIM, SGD, initializer=ZERO) for name in names]


def update(*names: str, dense: bool = True, ids: torch.Tensor = IDS) -> dict[str, torch.Tensor]:
    """A push of gradients of ones: the dense ``x`` (if ``dense``) and ``ids``' rows of each table named."""
    out = {"x": torch.ones(4)} if dense else {}
    for name in names:
        out[ids_key(name)], out[grads_key(name)] = ids, torch.ones(ids.numel(), DIM)
    return out


def in_thread(target, *args) -> tuple[threading.Thread, list]:
    """Run ``target(*args)`` in a thread; its result (or exception) lands in the list."""
    out: list = []

    def run() -> None:
        try:
            out.append(target(*args))
        except BaseException as exc:  # the test asserts on it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def joined(thread: threading.Thread, out: list):
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), "timed out"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def wait_until(condition, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def issued(store: VariableStore, table: str) -> int:
    """The tickets taken on ``table`` so far (requests admitted that touch it)."""
    with store._turns._cond:
        return store._turns._issued.get(table, 0)


def test_concurrent_pushes_and_their_resends_apply_once_and_no_reader_sees_half_a_push():
    """4 workers x 25 pushes, each push sent by two threads at once (its resend after a lost reply): applied once.
    Every push updates tables a and b and the dense x (and c on odd numbers); lookups and snapshots taken
    meanwhile always see a, b and x at the same count, and never fewer pushes than a read before them."""
    workers, pushes = 4, 25
    store = store_with(*tables("a", "b", "c"))
    done = threading.Event()
    seen: list[str] = []  # what a reader saw wrong

    def send(worker: int) -> None:
        for seq in range(1, pushes + 1):
            names = ("a", "b", "c") if seq % 2 else ("a", "b")
            store.apply(update(*names), advance_step=True, origin=Origin(worker, INCARNATION, seq))

    def read_lookups() -> int:
        last, reads = 0.0, 0
        while not done.is_set() or not reads:
            rows, _ = store.lookup({"a": IDS, "b": IDS})
            a, b = rows["a"], rows["b"]
            if not (bool((a == a[0, 0]).all()) and torch.equal(a, b)):
                seen.append(f"lookup: a {a.unique().tolist()} b {b.unique().tolist()}")
            if float(a[0, 0]) > last:
                seen.append(f"lookup went back from {last} to {float(a[0, 0])}")
            last, reads = float(a[0, 0]), reads + 1
        return reads

    def read_snapshots() -> int:
        reads = 0
        while not done.is_set() or not reads:
            state = store.snapshot()
            count = state.applied_updates
            values = {name: state.tables[name].values for name in ("a", "b")}
            if float(state.values["x"][0]) != -count or any(
                    v.numel() and not bool((v == -count).all()) for v in values.values()):
                seen.append(f"snapshot at {count}: x {float(state.values['x'][0])}, "
                            f"a {values['a'].unique().tolist()}, b {values['b'].unique().tolist()}")
            reads += 1
        return reads

    senders = [in_thread(send, worker) for worker in range(workers) for _ in range(2)]
    readers = [in_thread(read_lookups), in_thread(read_lookups), in_thread(read_snapshots)]
    try:
        for sender in senders:
            joined(*sender)
    finally:
        done.set()
    assert all(joined(*reader) > 0 for reader in readers)
    assert not seen, seen[:5]
    total = workers * pushes
    status = store.status()
    assert (status.applied_updates, status.accepted_pushes, status.retried_pushes) == (total, total, total)
    rows, step = store.lookup({"a": IDS, "b": IDS, "c": IDS})
    assert step == total and float(store.read()[0]["x"][0]) == -total
    assert bool((rows["a"] == -total).all()) and bool((rows["b"] == -total).all())
    assert bool((rows["c"] == -workers * ((pushes + 1) // 2)).all())


@pytest.mark.parametrize("request_kind", ["push", "lookup"])
def test_the_parts_of_one_request_on_two_tables_and_the_dense_variables_run_at_the_same_time(
        monkeypatch, request_kind):
    """Each part waits inside until every other part of the request is inside too: under one lock (one part
    after the other) the barrier times out and the request fails instead."""
    store = store_with(*tables("a", "b"))
    parties = 3 if request_kind == "push" else 2  # a push: a, b and the dense x
    barrier = threading.Barrier(parties, timeout=5)
    inside: set[str] = set()

    def meeting(original, label):
        def wrapped(self, *args, **kwargs):
            inside.add(label(self))
            barrier.wait()
            return original(self, *args, **kwargs)
        return wrapped

    if request_kind == "push":
        monkeypatch.setattr(EmbeddingShard, "apply", meeting(EmbeddingShard.apply, lambda s: s.spec.name))
        monkeypatch.setattr(Applier, "apply", meeting(Applier.apply, lambda _: "dense"))
        store.apply(update("a", "b"), advance_step=True)
        assert inside == {"a", "b", "dense"}
        monkeypatch.undo()
        rows, _ = store.lookup({"a": IDS, "b": IDS})
        assert bool((rows["a"] == -1).all()) and bool((rows["b"] == -1).all())
        assert float(store.read()[0]["x"][0]) == -1.0
    else:
        store.apply(update("a", "b"), advance_step=True)
        monkeypatch.setattr(EmbeddingShard, "lookup", meeting(EmbeddingShard.lookup, lambda s: s.spec.name))
        rows, step = store.lookup({"a": IDS, "b": IDS})
        assert inside == {"a", "b"} and step == 1
        assert bool((rows["a"] == -1).all()) and bool((rows["b"] == -1).all())


def push_ab(store: VariableStore) -> None:
    store.apply(update("a", "b", dense=False), advance_step=True)


def test_a_push_held_in_one_table_blocks_neither_other_tables_nor_dense_reads_and_is_seen_whole(monkeypatch):
    """A push of a and b stops inside table a. Meanwhile a push and a lookup of table c go through (one lock would
    hold them), as does a read of the dense x; a lookup of a and b waits for the push's a part and then sees the
    push on both tables, and a push of a and b admitted after it is applied after it on both."""
    store = store_with(*tables("a", "b", "c"))
    entered, release = threading.Event(), threading.Event()
    original = EmbeddingShard.apply

    def held_in_a(self, ids, grads, lr, update=0):
        if self.spec.name == "a" and update == 0:
            entered.set()
            assert release.wait(TIMEOUT_S)
        return original(self, ids, grads, lr, update)

    monkeypatch.setattr(EmbeddingShard, "apply", held_in_a)
    first = in_thread(push_ab, store)
    try:
        assert entered.wait(TIMEOUT_S)
        other = in_thread(lambda: (store.apply(update("c"), advance_step=True), store.lookup({"c": IDS})))
        _, (rows, _) = joined(*other)
        assert bool((rows["c"] == -1).all())
        assert float(store.read()[0]["x"][0]) == -1.0  # the c push's dense part
        lookup = in_thread(store.lookup, {"a": IDS, "b": IDS})
        wait_until(lambda: issued(store, "a") == 2)  # the lookup's turn on a is the second: then push again
        second = in_thread(push_ab, store)
        wait_until(lambda: issued(store, "a") == 3)
        lookup[0].join(0.2)
        assert lookup[0].is_alive() and second[0].is_alive()  # both wait for the first push's turn on a
    finally:
        release.set()
    joined(*first)
    joined(*second)
    rows, _ = joined(*lookup)
    assert bool((rows["a"] == -1).all()) and bool((rows["b"] == -1).all())  # the first push whole, not the second
    rows, _ = store.lookup({"a": IDS, "b": IDS})
    assert bool((rows["a"] == -2).all()) and bool((rows["b"] == -2).all())


def test_a_ttl_table_no_push_touches_is_swept_at_the_same_updates_as_before():
    """Sweeps are due by the update count, pushed to or not: table t (ttl 8) gets rows at updates 0 and 5 only,
    every other update pushes to u alone. Its rows go at the very updates a table swept after every update
    (the single-lock store's schedule) loses them."""
    ttl = TableSpec("t", DIM, SGD, initializer=ZERO, ttl_steps=8)
    store = store_with(ttl, *tables("u"))
    reference = EmbeddingShard(ttl)
    touched = {0: torch.tensor([1, 2]), 5: torch.tensor([3])}
    counts = []
    for step in range(30):
        ids = touched.get(step)
        push = update("t", dense=False, ids=ids) if ids is not None else update("u", dense=False)
        store.apply(push, advance_step=True)
        if ids is not None:
            reference.apply(ids, torch.ones(ids.numel(), DIM), 1.0, step)
        reference.sweep(step)
        counts.append((store.status().tables["t"].rows, store.status().tables["t"].evicted))
        assert counts[-1] == (len(reference), reference.evicted), (step, counts)
    assert counts[0] == (2, 0) and counts[-1] == (0, 3)  # every row came and went


def test_a_part_that_fails_still_hands_its_table_on():
    """A failing part's table serves the next ticket (the error is raised once every part ran): nothing hangs."""
    turns = TableTurns("ps:0")
    ran: list[str] = []

    def fail() -> None:
        raise RuntimeError("part failed")

    first = turns.take({"a": fail, "b": lambda: ran.append("b")})
    later = turns.take({"a": lambda: ran.append("a"), "b": lambda: ran.append("b again")})
    with pytest.raises(RuntimeError, match="part failed"):
        first.finish()
    assert later.finish() == {"a": None, "b": None}
    assert sorted(ran) == ["a", "b", "b again"]
    turns.drain()
