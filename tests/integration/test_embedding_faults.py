"""Embedding tables under faults: malformed sparse pushes and lookups, pushes sent twice, pushes cut mid-body.

Real ps servers on 127.0.0.1 (in this process), initialized with a dense variable per shard and
two tables (a growing Adagrad table, a fixed-size lazy-Adam table), and trained one step so that
rows, slots and counters are all non-trivial.  Hostile requests travel on a raw ``DataChannel``
(or a raw socket), as a buggy or malicious worker would send them, never through ``PsClient``
(which would refuse most of them itself).

What every refusal must leave behind: an ``InvalidArgumentError`` naming the defect, every shard
bit for bit as before (values, slots, averages, tables' ids, rows and row slots, step, every
counter), the push's origin not taken (the same origin is a new push afterwards, not a retry),
and a connection that still serves: a good push and a good lookup on it succeed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorfleet.cluster.idhash import shard_of
from tensorfleet.errors import InvalidArgumentError, TensorfleetError
from tensorfleet.ps import layout as ps_layout
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer, SyncOptions, TableSpec
from tensorfleet.protocol.messages import Origin, PushRequest, grads_key, ids_key, tables_named
from tensorfleet.ps.server import Server
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.wire import frame
from tensorfleet.wire.codec import TensorEntry
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.worker.client import PsClient

TIMEOUT_S = 10.0
NUM_PS = 2
TARGET = 1  # the shard the hostile requests go to (not ps 0: no global step in play)
GROW, FIXED, ROWS = "grow", "fixed", 49  # ROWS: an id (just outside) of shard TARGET
ADAGRAD_LR, ADAGRAD_EPS = 0.1, 1e-10
TABLES = (
    TableSpec(GROW, 3, OptimizerSpec("adagrad", {"lr": ADAGRAD_LR, "initial_accumulator_value": 0.0,
                                                 "eps": ADAGRAD_EPS}),
              initializer=RowInitializer.normal(0.2, seed=7)),
    TableSpec(FIXED, 2, OptimizerSpec("adam", {"lr": 0.05}), num_rows=ROWS,
              initializer=RowInitializer.uniform(-0.1, 0.1, seed=8)),
)
DIM = {spec.name: spec.dim for spec in TABLES}
VALUES = {"w": torch.arange(4, dtype=torch.float32), "v": torch.tensor([1.0, -2.0, 0.5])}
PLACEMENT = {"w": 0, "v": 1}


def ids_on(shard: int, count: int, *, start: int = 0, stop: int = ROWS) -> torch.Tensor:
    """The first ``count`` ids in start..stop-1 that hash to ``shard`` (of NUM_PS)."""
    candidates = torch.arange(start, stop)
    found = candidates[torch.from_numpy(shard_of(candidates, NUM_PS) == shard)][:count]
    assert found.numel() == count, f"fewer than {count} ids of shard {shard} in {start}..{stop - 1}"
    return found


MINE = ids_on(TARGET, 3)  # ids of the target shard (all < ROWS: valid for both tables)
THEIRS = ids_on(1 - TARGET, 1)  # an id of the other shard
# The first ids outside the fixed table, on either side, hash to the target shard: refused for the range alone.
assert (shard_of(torch.tensor([ROWS, -1]), NUM_PS) == TARGET).all()


def rows_push(table: str, ids: torch.Tensor, grads: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A table's part of a push: its ids and one row gradient per id."""
    if grads is None:
        grads = torch.linspace(-1.0, 1.0, ids.numel() * DIM[table]).reshape(ids.numel(), DIM[table])
    return {ids_key(table): ids, grads_key(table): grads}


def declared(meta: dict[str, Any], tensors: Any) -> dict[str, Any]:
    """A push's meta declaring the tables whose ids its tensors (or wire entries) carry, as PsClient does."""
    names = [entry.name for entry in tensors] if isinstance(tensors, list) else list(tensors)
    return {**meta, "tables": list(tables_named(names))}


def good_push() -> dict[str, torch.Tensor]:
    return {**rows_push(GROW, MINE), **rows_push(FIXED, MINE[:2])}


# --- the shards under fire, and what "unchanged" means ------------------------------------------------


_origins = itertools.count(1)
INCARNATION = time.time_ns()


def next_origin() -> Origin:
    """A push origin never used before in this file (worker 1 of the job, one incarnation, counting up)."""
    return Origin(1, INCARNATION, next(_origins))


@dataclasses.dataclass
class Fleet:
    servers: list[Server]
    client: PsClient
    channel: DataChannel  # a raw connection to ps TARGET's data port

    def connection(self, shard: int = TARGET) -> DataChannel:
        channel = DataChannel(task=f"/job:ps/task:{shard}")
        channel.set_address("127.0.0.1", self.servers[shard].service.data_port)
        return channel


@contextlib.contextmanager
def _no_token() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TENSORFLEET_TOKEN", raising=False)  # no token: a raw socket needs no Hello
        env.delenv("TENSORFLEET_TOKEN_FILE", raising=False)
        yield


@contextlib.contextmanager
def fleet_of(tables=TABLES, sync: SyncOptions | None = None) -> Iterator[Fleet]:
    with _no_token(), ps_servers(num_ps=NUM_PS, num_workers=2) as (cluster, servers):
        client = PsClient(cluster, PLACEMENT, tables=tables)
        client.wait_for_shards(TIMEOUT_S)
        client.initialize(VALUES, OptimizerSpec.sgd(lr=0.5, momentum=0.9), sync=sync, average_decay=0.9)
        fleet = Fleet(servers, client, None)  # type: ignore[arg-type]
        fleet.channel = fleet.connection()
        try:
            yield fleet
        finally:
            fleet.channel.close()
            client.close()


@pytest.fixture(scope="module")
def trained() -> Iterator[Fleet]:
    """Shared by the refusal tests (each compares against its own 'before'): trained one step with rows on
    both shards of both tables, so that rows, row slots, momentum and averages are all non-trivial."""
    with fleet_of() as fleet:
        ids = torch.cat([MINE, THEIRS, ids_on(1 - TARGET, 2, start=ROWS, stop=4 * ROWS)])
        fleet.client.push({name: torch.full_like(value, 0.5) for name, value in VALUES.items()},
                          rows={GROW: (ids, torch.ones(ids.numel(), DIM[GROW])),
                                FIXED: (MINE, torch.full((MINE.numel(), DIM[FIXED]), -0.5))})
        for server in fleet.servers:
            assert server.store.status().tables[GROW].rows > 0
        yield fleet


def _bits(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    flat = tensor.detach().contiguous().reshape(-1)
    return str(tensor.dtype), tuple(tensor.shape), bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b""


def fleet_state(fleet: Fleet) -> list[dict[str, Any]]:
    """Everything a request could change, per shard: every tensor of its snapshot (values, slots, averages,
    tables' ids, rows and row slots) bit for bit, its step and updates, and every counter of its status but
    the ids looked up (traffic, which an answered lookup counts, not state)."""
    states = []
    for server in fleet.servers:
        snapshot = server.store.snapshot()
        status = dataclasses.asdict(server.store.status())
        for figures in status["tables"].values():
            figures.pop("lookups", None)
        states.append({"tensors": {name: _bits(t) for name, t in snapshot.flatten().items()},
                       "global_step": snapshot.global_step, "applied_updates": snapshot.applied_updates,
                       "status": status})
    return states


def table_rows(server: Server, table: str) -> dict[int, torch.Tensor]:
    state = server.store.snapshot().tables[table]
    return dict(zip(state.ids.tolist(), state.values))


@contextlib.contextmanager
def still_serving(fleet: Fleet, origin: Origin, *, rejected: int = 0) -> Iterator[None]:
    """Around one hostile request on ``fleet.channel``: every shard is bit for bit as before (but for
    ``rejected`` more NaN/Inf rejections), and then, on the same connection, the refused push's origin is a
    new push (it was not taken), a good push is applied and a good lookup answers the shard's rows."""
    before = fleet_state(fleet)
    sock = fleet.channel._sock  # noqa: SLF001 - the connection the hostile request rides (None: not yet open)
    yield
    after = fleet_state(fleet)
    before[TARGET]["status"]["rejected_nonfinite"] += rejected
    assert after == before, "a refused request changed a shard"
    if sock is not None:
        assert fleet.channel._sock is sock, "the refusal cost the connection"  # noqa: SLF001
    sock = fleet.channel._sock  # noqa: SLF001
    applied_before = fleet.servers[TARGET].store.status().applied_updates
    push = good_push()
    meta, _ = fleet.channel.call("Push", declared(PushRequest(origin).to_meta(), push), push, timeout=TIMEOUT_S)
    assert meta["outcome"] == "applied", f"the refused push's origin was taken: {meta}"
    assert fleet.servers[TARGET].store.status().applied_updates == applied_before + 1
    _, rows = fleet.channel.call("Lookup", {}, {GROW: MINE, FIXED: MINE}, timeout=TIMEOUT_S)
    for table in (GROW, FIXED):
        held = table_rows(fleet.servers[TARGET], table)
        assert torch.equal(rows[table], torch.stack([held[i] for i in MINE.tolist()])), table
    assert fleet.channel._sock is sock  # noqa: SLF001 - one connection throughout


def refused(call: Callable[[], Any], match: str) -> InvalidArgumentError:
    """The call must fail with InvalidArgumentError (INVALID_ARGUMENT on the wire) whose message matches."""
    with pytest.raises(InvalidArgumentError, match=match) as caught:
        call()
    return caught.value


# --- malformed pushes ---------------------------------------------------------------------------------

def _swap(tensors: dict[str, torch.Tensor], name: str, value: torch.Tensor | None) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    if value is None:
        del out[name]
    else:
        out[name] = value
    return out


G = rows_push(GROW, MINE)  # a well-formed part: every case below breaks one thing of it
BAD_PUSHES = [
    pytest.param(_swap(G, ids_key(GROW), MINE.float()), r"'grow': ids must be int64 of one dimension, got "
                 r"torch.float32", id="ids-float32"),
    pytest.param(_swap(G, ids_key(GROW), MINE.to(torch.int32)), r"ids must be int64 of one dimension, got torch.int32",
                 id="ids-int32"),
    pytest.param(_swap(G, ids_key(GROW), MINE.reshape(3, 1)), r"ids must be int64 of one dimension, got "
                 r"torch.int64 \(3, 1\)", id="ids-2d"),
    pytest.param(_swap(G, ids_key(GROW), MINE[:2]), r"2 ids need torch.float32 gradients of shape \(2, 3\), got "
                 r"torch.float32 \(3, 3\)", id="fewer-ids-than-grads"),
    pytest.param(_swap(G, grads_key(GROW), torch.ones(4, 3)), r"3 ids need .* shape \(3, 3\), got torch.float32 "
                 r"\(4, 3\)", id="more-grads-than-ids"),
    pytest.param(_swap(G, grads_key(GROW), torch.ones(3, 4)), r"shape \(3, 3\), got torch.float32 \(3, 4\)",
                 id="grads-wrong-dim"),
    pytest.param(_swap(G, grads_key(GROW), torch.ones(3)), r"shape \(3, 3\), got torch.float32 \(3,\)",
                 id="grads-1d"),
    pytest.param(_swap(G, grads_key(GROW), torch.ones(3, 3, dtype=torch.float64)),
                 r"need torch.float32 gradients .* got torch.float64", id="grads-float64"),
    pytest.param(_swap(G, grads_key(GROW), torch.ones(3, 3, dtype=torch.bfloat16)),
                 r"need torch.float32 gradients .* got torch.bfloat16", id="grads-bfloat16-undeclared"),
    pytest.param(_swap(G, grads_key(GROW), None), r"'grow': a push carries both '@ids/grow' and '@grads/grow'",
                 id="ids-without-grads"),
    pytest.param(_swap(G, ids_key(GROW), None), r"'grow': a push carries both '@ids/grow' and '@grads/grow'",
                 id="grads-without-ids"),
    pytest.param(rows_push("nope", MINE, torch.ones(3, 3)), r"'@ids/nope' names no embedding table of this shard "
                 r"\(tables: fixed, grow\)", id="unknown-table"),
    pytest.param({**G, "@something/grow": torch.ones(3)}, r"'@something/grow' names no embedding table",
                 id="at-entry-not-ids-or-grads"),
    pytest.param({**G, "@ids": torch.ones(3, dtype=torch.int64)}, r"'@ids' names no embedding table",
                 id="at-ids-without-table"),
    pytest.param({"@": torch.ones(1)}, r"'@' names no embedding table", id="bare-at"),
    pytest.param(rows_push(GROW, MINE[[0, 1, 0]]), rf"'grow': id {int(MINE[0])} appears twice", id="duplicate-ids"),
    pytest.param({**G, **rows_push(FIXED, MINE[[2, 1, 2]])}, rf"'fixed': id {int(MINE[2])} appears twice",
                 id="duplicate-ids-in-the-second-table"),
    pytest.param(rows_push(GROW, torch.cat([MINE, THEIRS])),
                 rf"'grow': id {int(THEIRS[0])} lives on ps {1 - TARGET}, not on this shard \({TARGET} of {NUM_PS}\)",
                 id="id-of-another-shard"),
    pytest.param(rows_push(FIXED, torch.cat([MINE[:1], torch.tensor([ROWS])])),
                 rf"'fixed' has {ROWS} rows \(ids 0..{ROWS - 1}\); got id {ROWS}", id="fixed-id-num-rows"),
    pytest.param(rows_push(FIXED, torch.cat([MINE[:1], torch.tensor([2 ** 63 - 1])])),
                 rf"'fixed' has {ROWS} rows \(ids 0..{ROWS - 1}\); got id {2 ** 63 - 1}", id="fixed-id-int64-max"),
    pytest.param(rows_push(FIXED, torch.cat([MINE[:1], torch.tensor([-1])])),
                 rf"'fixed' has {ROWS} rows \(ids 0..{ROWS - 1}\); got id -1", id="fixed-id-minus-1"),
    pytest.param(rows_push(FIXED, torch.cat([MINE[:1], torch.tensor([-2 ** 63])])),  # (its home is ps 0)
                 rf"'fixed' has {ROWS} rows \(ids 0..{ROWS - 1}\); got id {-2 ** 63}|id {-2 ** 63} lives on ps 0",
                 id="fixed-id-int64-min"),
    pytest.param({**rows_push(GROW, MINE), "v": torch.ones(3), "w": torch.ones(4)},
                 r"unknown variable 'w': this shard holds v", id="dense-variable-of-another-shard"),
]


@pytest.mark.parametrize("tensors, match", BAD_PUSHES)
def test_a_malformed_sparse_push_is_refused_and_changes_nothing(trained, tensors, match):
    origin = next_origin()
    with still_serving(trained, origin):
        refused(lambda: trained.channel.call("Push", declared(PushRequest(origin).to_meta(), tensors), tensors,
                                             timeout=TIMEOUT_S), match)


@pytest.mark.parametrize("edge", [0, ROWS - 1], ids=["zero", "num-rows-minus-1"])
def test_fixed_size_boundary_ids_are_accepted(trained, edge):
    """The refusals above are not off by one: ids 0 and num_rows - 1 are rows of the fixed table."""
    ids = torch.tensor([edge])
    home = int(shard_of(ids, NUM_PS)[0])
    channel = trained.channel if home == TARGET else trained.connection(home)
    try:
        tensors = rows_push(FIXED, ids)
        meta, _ = channel.call("Push", declared(PushRequest(next_origin(), advance_step=home == 0).to_meta(), tensors),
                               tensors, timeout=TIMEOUT_S)
        _, looked = channel.call("Lookup", {}, {FIXED: ids}, timeout=TIMEOUT_S)
    finally:
        if channel is not trained.channel:
            channel.close()
    assert meta["outcome"] == "applied"
    assert torch.equal(looked[FIXED][0], table_rows(trained.servers[home], FIXED)[edge])


def test_nan_in_row_gradients_is_rejected_and_applies_nothing(trained):
    """NaN/Inf in a table's row gradients (the dense part finite): outcome 'rejected', counted, nothing of the
    push applied (neither the rows nor the dense gradient beside them)."""
    origin = next_origin()
    grads = torch.ones(3, DIM[GROW])
    grads[1, 2] = float("nan")
    tensors = {**rows_push(GROW, MINE, grads), **rows_push(FIXED, MINE[:1]), "v": torch.ones(3)}
    with still_serving(trained, origin, rejected=1):
        meta, _ = trained.channel.call("Push", declared(PushRequest(origin).to_meta(), tensors), tensors,
                                       timeout=TIMEOUT_S)
        assert meta["outcome"] == "rejected"


def test_inf_in_row_gradients_of_a_narrowed_push_is_rejected(trained):
    """The same through a bfloat16 push (the rows upcast before the check)."""
    origin = next_origin()
    grads = torch.ones(3, DIM[GROW], dtype=torch.bfloat16)
    grads[0, 0] = float("-inf")
    meta = PushRequest(origin, wire_dtype=torch.bfloat16).to_meta()
    with still_serving(trained, origin, rejected=1):
        tensors = rows_push(GROW, MINE, grads)
        reply, _ = trained.channel.call("Push", declared(meta, tensors), tensors, timeout=TIMEOUT_S)
        assert reply["outcome"] == "rejected"


def test_too_many_ids_in_one_push_are_refused_before_the_body(trained, monkeypatch):
    monkeypatch.setattr(ps_layout, "MAX_IDS_PER_REQUEST", 2)
    origin = next_origin()
    with still_serving(trained, origin):
        tensors = rows_push(GROW, MINE)
        refused(lambda: trained.channel.call("Push", declared(PushRequest(origin).to_meta(), tensors), tensors,
                                             timeout=TIMEOUT_S), r"'grow': 3 ids in one push; at most 2")
        monkeypatch.undo()  # the good push after it carries 3


# --- malformed lookups -----------------------------------------------------------------------------------

BAD_LOOKUPS = [
    pytest.param({"nope": MINE}, r"Lookup: 'nope' is no embedding table of this shard \(tables: fixed, grow\)",
                 id="unknown-table"),
    pytest.param({ids_key(GROW): MINE}, r"Lookup: '@ids/grow' is no embedding table", id="push-entry-name"),
    pytest.param({GROW: MINE.float()}, r"Lookup: ids of table 'grow' must be int64 of one dimension, got "
                 r"torch.float32", id="ids-float32"),
    pytest.param({GROW: MINE.to(torch.int32)}, r"must be int64 of one dimension, got torch.int32", id="ids-int32"),
    pytest.param({GROW: MINE.reshape(1, 3)}, r"must be int64 of one dimension, got torch.int64 \(1, 3\)",
                 id="ids-2d"),
    pytest.param({GROW: torch.tensor(int(MINE[0]))}, r"must be int64 of one dimension, got torch.int64 \(\)",
                 id="ids-0d"),
    pytest.param({GROW: torch.cat([MINE, THEIRS])}, rf"'grow': id {int(THEIRS[0])} lives on ps {1 - TARGET}",
                 id="id-of-another-shard"),
    pytest.param({FIXED: torch.tensor([0, ROWS])}, rf"'fixed' has {ROWS} rows \(ids 0..{ROWS - 1}\); got id {ROWS}",
                 id="fixed-id-num-rows"),
    pytest.param({FIXED: torch.tensor([-1, 0])}, rf"'fixed' has {ROWS} rows \(ids 0..{ROWS - 1}\); got id -1",
                 id="fixed-id-minus-1"),
]


@pytest.mark.parametrize("tensors, match", BAD_LOOKUPS)
def test_a_malformed_lookup_is_refused_and_changes_nothing(trained, tensors, match):
    with still_serving(trained, next_origin()):
        refused(lambda: trained.channel.call("Lookup", {}, tensors, timeout=TIMEOUT_S), match)


def test_a_lookup_with_more_ids_than_the_bound_is_refused(trained, monkeypatch):
    monkeypatch.setattr(ps_layout, "MAX_IDS_PER_REQUEST", 2)
    with still_serving(trained, next_origin()):
        refused(lambda: trained.channel.call("Lookup", {}, {GROW: MINE}, timeout=TIMEOUT_S),
                r"Lookup: 3 ids of table 'grow' in one request; at most 2")
        trained.channel.call("Lookup", {}, {GROW: MINE[:2]}, timeout=TIMEOUT_S)  # at the bound: answered
        monkeypatch.undo()


def test_a_lookup_with_duplicate_ids_is_answered_and_creates_nothing(trained):
    """Lookups may repeat ids (only pushes must not), and never create rows."""
    ids = torch.cat([MINE[[0, 0]], ids_on(TARGET, 1, start=10 * ROWS, stop=20 * ROWS)])  # the last: never pushed
    with still_serving(trained, next_origin()):
        _, rows = trained.channel.call("Lookup", {}, {GROW: ids}, timeout=TIMEOUT_S)
        held = table_rows(trained.servers[TARGET], GROW)
        assert torch.equal(rows[GROW][0], held[int(ids[0])]) and torch.equal(rows[GROW][1], held[int(ids[0])])
        assert int(ids[2]) not in held
        assert torch.equal(rows[GROW][2], TABLES[0].initializer.rows(ids[2:], DIM[GROW])[0])


# --- extreme ids are ids ----------------------------------------------------------------------------------

@pytest.mark.parametrize("extreme", [2 ** 63 - 1, -2 ** 63, -1, 0], ids=["int64-max", "int64-min", "minus-1", "zero"])
def test_extreme_int64_ids_are_accepted_by_a_growing_table(trained, extreme):
    """Any int64 is an id of a growing table: pushed to the shard it hashes to, created there with its initial
    row updated once (Adagrad), looked up again, and never on the other shard."""
    ids = torch.tensor([extreme])
    home = int(shard_of(ids, NUM_PS)[0])
    channel = trained.channel if home == TARGET else trained.connection(home)
    try:
        initial = TABLES[0].initializer.rows(ids, DIM[GROW])
        _, looked = channel.call("Lookup", {}, {GROW: ids}, timeout=TIMEOUT_S)
        held = table_rows(trained.servers[home], GROW)
        start = held.get(extreme, initial[0])
        if extreme not in held:
            assert torch.equal(looked[GROW][0], initial[0])
        grads = torch.tensor([[0.5, -2.0, 1.0]])
        slot_before = _slot(trained.servers[home], extreme)
        tensors = rows_push(GROW, ids, grads)
        meta, _ = channel.call("Push", declared(PushRequest(next_origin(), advance_step=home == 0).to_meta(), tensors),
                               tensors, timeout=TIMEOUT_S)
        assert meta["outcome"] == "applied"
        held = table_rows(trained.servers[home], GROW)
        total = slot_before + grads[0] * grads[0]
        expected = start - ADAGRAD_LR * grads[0] / (total.sqrt() + ADAGRAD_EPS)
        torch.testing.assert_close(held[extreme], expected)
        assert extreme not in table_rows(trained.servers[1 - home], GROW)
        _, looked = channel.call("Lookup", {}, {GROW: ids}, timeout=TIMEOUT_S)
        assert torch.equal(looked[GROW][0], held[extreme])
        looked = trained.client.lookup({GROW: torch.tensor([extreme, extreme ^ 1])})  # through the client too
        assert torch.equal(looked[GROW][0], held[extreme])
    finally:
        if channel is not trained.channel:
            channel.close()


def _slot(server: Server, row_id: int) -> torch.Tensor:
    state = server.store.snapshot().tables[GROW]
    where = (state.ids == row_id).nonzero()
    return state.slots["sum"][int(where[0, 0])] if where.numel() else torch.zeros(DIM[GROW])


# --- exactly once for sparse pushes ------------------------------------------------------------------------

EO_LR = 0.5
EO_TABLE = TableSpec("emb", 2, OptimizerSpec("sgd", {"lr": EO_LR}), initializer=RowInitializer.normal(0.1, seed=3))
EO_IDS = ids_on(TARGET, 4, start=-100, stop=100)


def _eo_push(grads_scale: float, ids: torch.Tensor = EO_IDS) -> dict[str, torch.Tensor]:
    grads = torch.arange(ids.numel() * 2, dtype=torch.float32).reshape(-1, 2) * grads_scale + 1
    return {ids_key("emb"): ids, grads_key("emb"): grads, "v": torch.full((3,), grads_scale)}


def _eo_rows(server: Server) -> dict[int, torch.Tensor]:
    state = server.store.snapshot().tables["emb"]
    return dict(zip(state.ids.tolist(), state.values))


def test_an_async_sparse_push_sent_twice_changes_the_rows_once():
    """The same push (same worker, incarnation, seq) again, on another connection as after a broken one:
    'retried', the rows, the dense variable beside them and every tensor bit for bit as after the first."""
    with fleet_of(tables=(EO_TABLE,)) as fleet:
        server = fleet.servers[TARGET]
        initial = EO_TABLE.initializer.rows(EO_IDS, 2)
        meta = PushRequest(Origin(0, 5, 1)).to_meta()
        first, _ = fleet.channel.call("Push", declared(meta, _eo_push(1.0)), _eo_push(1.0), timeout=TIMEOUT_S)
        assert first["outcome"] == "applied"
        after_first = fleet_state(fleet)
        rows = _eo_rows(server)
        expected = initial - EO_LR * _eo_push(1.0)[grads_key("emb")]
        torch.testing.assert_close(torch.stack([rows[i] for i in EO_IDS.tolist()]), expected)
        other = fleet.connection()
        try:
            again, _ = other.call("Push", declared(meta, _eo_push(1.0)), _eo_push(1.0), timeout=TIMEOUT_S)
        finally:
            other.close()
        assert again["outcome"] == "retried"
        after_again = fleet_state(fleet)
        assert after_again[TARGET]["tensors"] == after_first[TARGET]["tensors"]
        status = server.store.status()
        assert (status.applied_updates, status.accepted_pushes, status.retried_pushes) == (1, 1, 1)
        assert status.tables["emb"].rows == EO_IDS.numel()
        # An older seq of the same incarnation is a retry too; the next seq is a new push.
        tensors = _eo_push(3.0)
        assert fleet.channel.call("Push", declared(PushRequest(Origin(0, 5, 1)).to_meta(), tensors), tensors,
                                  timeout=TIMEOUT_S)[0]["outcome"] == "retried"
        assert fleet_state(fleet)[TARGET]["tensors"] == after_first[TARGET]["tensors"]
        tensors = _eo_push(1.0)
        assert fleet.channel.call("Push", declared(PushRequest(Origin(0, 5, 2)).to_meta(), tensors), tensors,
                                  timeout=TIMEOUT_S)[0]["outcome"] == "applied"
        rows = _eo_rows(server)
        torch.testing.assert_close(torch.stack([rows[i] for i in EO_IDS.tolist()]),
                                   initial - 2 * EO_LR * _eo_push(1.0)[grads_key("emb")])


def test_a_sync_sparse_push_sent_twice_counts_once_toward_its_step():
    """Sync, one gradient per step: the retry of a completed step's push is 'retried' and applies nothing."""
    sync = SyncOptions(replicas_to_aggregate=1, total_num_replicas=2, timeout_s=TIMEOUT_S)
    with fleet_of(tables=(EO_TABLE,), sync=sync) as fleet:
        server = fleet.servers[TARGET]
        meta = PushRequest(Origin(0, 5, 1), replica=0, step=0).to_meta()
        first, _ = fleet.channel.call("Push", declared(meta, _eo_push(1.0)), _eo_push(1.0), timeout=TIMEOUT_S)
        assert first["outcome"] == "complete" and first["step"] == 1
        after_first = fleet_state(fleet)
        other = fleet.connection()
        try:
            again, _ = other.call("Push", declared(meta, _eo_push(1.0)), _eo_push(1.0), timeout=TIMEOUT_S)
        finally:
            other.close()
        assert again["outcome"] == "retried" and again["step"] == 1
        assert fleet_state(fleet)[TARGET]["tensors"] == after_first[TARGET]["tensors"]
        status = server.store.status()
        assert (status.global_step, status.applied_updates, status.accepted_pushes, status.retried_pushes,
                status.dropped_duplicate) == (1, 1, 1, 1, 0)


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _in_background(replies: dict[str, Any], key: str, channel: DataChannel, meta: dict,
                   tensors: dict[str, torch.Tensor]) -> threading.Thread:
    """A push on its own thread (a sync push waits for its step); its reply's meta lands in ``replies[key]``."""
    def send() -> None:
        replies[key] = channel.call("Push", declared(meta, tensors), tensors, timeout=TIMEOUT_S)[0]

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _expected_after_one_sync_step(server: Server, v_before: torch.Tensor,
                                  pushes: list[dict[str, torch.Tensor]]) -> None:
    """The shard after one step of plain SGD on the mean of ``pushes`` (one per replica): each row moved by
    the sum of its gradients over the replicas that sent it, over the number of replicas (a replica that did
    not touch it counts as zero); the dense variable by momentum SGD's first step on the mean."""
    expected: dict[int, torch.Tensor] = {}
    for push in pushes:
        ids = push[ids_key("emb")]
        for i, row in zip(ids.tolist(), EO_TABLE.initializer.rows(ids, 2)):
            expected.setdefault(i, row.clone())
    for push in pushes:
        for i, grad in zip(push[ids_key("emb")].tolist(), push[grads_key("emb")]):
            expected[i] -= EO_LR * grad / len(pushes)
    rows = _eo_rows(server)
    assert rows.keys() == expected.keys()
    for i in expected:
        torch.testing.assert_close(rows[i], expected[i])
    mean_v = sum(push["v"] for push in pushes) / len(pushes)
    torch.testing.assert_close(server.store.read()[0]["v"], v_before - 0.5 * mean_v)


def test_a_sync_sparse_push_resent_while_its_step_is_open_is_counted_once_in_the_mean():
    """Sync, two gradients per step: replica 0's push waits for replica 1; its copy, resent meanwhile on
    another connection, waits too and is answered 'retried'. The step applies the mean of replica 0's and
    replica 1's rows, not replica 0's twice."""
    sync = SyncOptions(replicas_to_aggregate=2, total_num_replicas=2, timeout_s=TIMEOUT_S)
    with fleet_of(tables=(EO_TABLE,), sync=sync) as fleet:
        server = fleet.servers[TARGET]
        v_before = server.store.read()[0]["v"].clone()
        meta0 = PushRequest(Origin(0, 5, 1), replica=0, step=0).to_meta()
        push0 = _eo_push(1.0)
        push1 = _eo_push(-2.0, torch.cat([EO_IDS[:2], ids_on(TARGET, 1, start=200, stop=400)]))  # partly the same
        channels = [fleet.connection() for _ in range(3)]
        replies: dict[str, Any] = {}
        try:
            threads = [_in_background(replies, "first", channels[0], meta0, push0)]
            _wait_for(lambda: server.store.status().accepted_pushes == 1, "replica 0's push to be accepted")
            threads.append(_in_background(replies, "copy", channels[1], meta0, push0))
            _wait_for(lambda: server.store.status().retried_pushes == 1, "the copy to be recognized")
            assert server.store.status().global_step == 0 and not replies
            meta1 = declared(PushRequest(Origin(1, 6, 1), replica=1, step=0).to_meta(), push1)
            replies["replica 1"] = channels[2].call("Push", meta1, push1, timeout=TIMEOUT_S)[0]
            for thread in threads:
                thread.join(TIMEOUT_S)
        finally:
            for channel in channels:
                channel.close()
        assert (replies["first"]["outcome"], replies["copy"]["outcome"], replies["replica 1"]["outcome"]) == \
            ("accepted", "retried", "complete")
        status = server.store.status()
        assert (status.global_step, status.applied_updates, status.accepted_pushes, status.retried_pushes) == \
            (1, 1, 2, 1)
        _expected_after_one_sync_step(server, v_before, [push0, push1])


@pytest.mark.parametrize("defect, match", [
    pytest.param("duplicate-ids", rf"id {int(EO_IDS[1])} appears twice", id="duplicate-ids"),
    pytest.param("id-of-another-shard", rf"id {int(THEIRS[0])} lives on ps {1 - TARGET}", id="id-of-another-shard"),
    pytest.param("grads-without-ids", r"a push carries both '@ids/emb' and '@grads/emb'", id="grads-without-ids"),
])
def test_a_refused_sync_sparse_push_leaves_nothing_in_its_step(defect, match):
    """Sync: a push refused for its rows is not offered to its step. Its replica's good push (same origin)
    then counts, and the step applies the mean of the replicas' good pushes only."""
    sync = SyncOptions(replicas_to_aggregate=2, total_num_replicas=2, timeout_s=TIMEOUT_S)
    with fleet_of(tables=(EO_TABLE,), sync=sync) as fleet:
        server = fleet.servers[TARGET]
        v_before = server.store.read()[0]["v"].clone()
        bad = {"duplicate-ids": _eo_push(1.0, EO_IDS[[0, 1, 2, 1]]),
               "id-of-another-shard": _eo_push(1.0, torch.cat([EO_IDS[:2], THEIRS])),
               "grads-without-ids": _swap(_eo_push(1.0), ids_key("emb"), None)}[defect]
        meta0 = PushRequest(Origin(0, 5, 1), replica=0, step=0).to_meta()
        before = fleet_state(fleet)
        refused(lambda: fleet.channel.call("Push", declared(meta0, bad), bad, timeout=TIMEOUT_S), match)
        assert fleet_state(fleet) == before
        push0, push1 = _eo_push(1.0), _eo_push(-2.0, EO_IDS[1:3])
        other = fleet.connection()
        replies: dict[str, Any] = {}
        try:
            thread = _in_background(replies, "replica 0", fleet.channel, meta0, push0)
            _wait_for(lambda: server.store.status().accepted_pushes == 1, "replica 0's push to be accepted")
            meta1 = declared(PushRequest(Origin(1, 6, 1), replica=1, step=0).to_meta(), push1)
            replies["replica 1"] = other.call("Push", meta1, push1, timeout=TIMEOUT_S)[0]
            thread.join(TIMEOUT_S)
        finally:
            other.close()
        assert (replies["replica 0"]["outcome"], replies["replica 1"]["outcome"]) == ("accepted", "complete")
        status = server.store.status()
        assert (status.global_step, status.accepted_pushes, status.dropped_duplicate) == (1, 2, 0)
        _expected_after_one_sync_step(server, v_before, [push0, push1])


# --- a push cut mid-body -------------------------------------------------------------------------------------

def _serving_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == f"data-/job:ps/task:{TARGET}"}


def _blocked_connection(serving: set[threading.Thread]) -> threading.Thread:
    """The ps's thread of the connection opened since ``serving`` was taken, waiting for the rest of a message
    that has not come whole (so it cannot have ended yet)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (new := _serving_threads() - serving):  # the ps may not have accepted the connection yet
        assert time.monotonic() < deadline, "the ps never served the connection"
        time.sleep(0.005)
    assert len(new) == 1, new
    return new.pop()


def _ended(thread: threading.Thread) -> None:
    """The ps's thread of a cut connection has ended: it has read all it will and applied what it would have
    (so comparing the shards afterwards is not a race the ps wins by being slow)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            thread.join(max(deadline - time.monotonic(), 0.0))
            break
        except RuntimeError:  # still being started
            time.sleep(0.005)
    assert not thread.is_alive(), "the ps still serves a connection that was closed mid-message"


def _wire_push(origin: Origin) -> tuple[bytes, dict[str, torch.Tensor]]:
    tensors = {**good_push(), "v": torch.full((3,), 0.25)}
    entries = [TensorEntry.of(name, tensor) for name, tensor in tensors.items()]
    head = frame.encode_head("Push", declared(PushRequest(origin).to_meta(), entries), entries)
    return head + b"".join(bytes(frame.tensor_bytes(t)) for t in tensors.values()), tensors


CUTS = ["in-the-prefix", "in-the-header", "after-the-head", "after-the-ids", "mid-body", "one-byte-short"]


def _cut_point(cut: str, message: bytes, tensors: dict[str, torch.Tensor]) -> int:
    body = sum(t.numel() * t.element_size() for t in tensors.values())
    head = len(message) - body
    first = next(iter(tensors.values()))
    assert first.dtype == torch.int64  # the ids of the first table
    return {"in-the-prefix": frame.PREFIX.size // 2, "in-the-header": head - 5, "after-the-head": head,
            "after-the-ids": head + first.numel() * first.element_size(), "mid-body": head + body // 2,
            "one-byte-short": len(message) - 1}[cut]


@pytest.mark.parametrize("cut", CUTS)
def test_a_sparse_push_cut_mid_message_applies_nothing(trained, cut):
    """A raw socket sends a good push (rows of both tables and a dense gradient) up to ``cut`` and closes:
    nothing of it is applied, and its origin is still new (sent whole afterwards, it is applied)."""
    origin = next_origin()
    message, tensors = _wire_push(origin)
    before = fleet_state(trained)
    serving = _serving_threads()
    with socket.create_connection(("127.0.0.1", trained.servers[TARGET].service.data_port), timeout=TIMEOUT_S) as sock:
        sock.sendall(message[:_cut_point(cut, message, tensors)])
        connection = _blocked_connection(serving)  # it waits for the rest
        sock.shutdown(socket.SHUT_WR)
        try:
            head = frame.Reader(sock).read_head(max_body_bytes=1 << 30)
            status = "closed" if head is None else head.kind
        except (OSError, TensorfleetError):
            status = "closed"
    _ended(connection)
    assert status != "OK"
    assert fleet_state(trained) == before
    reply, _ = trained.channel.call("Push", declared(PushRequest(origin).to_meta(), tensors), tensors,
                                    timeout=TIMEOUT_S)
    assert reply["outcome"] == "applied"


def test_a_streamed_sparse_push_aborted_after_its_ids_applies_nothing(trained):
    """The client's own way of giving up mid-push (``Stream.abort``: the connection is closed mid-message),
    after the ids went out and before the row gradients did."""
    origin = next_origin()
    tensors = good_push()
    before = fleet_state(trained)
    serving = _serving_threads()
    channel = trained.connection()
    try:
        entries = [TensorEntry.of(name, tensor) for name, tensor in tensors.items()]
        stream = channel.stream("Push", declared(PushRequest(origin).to_meta(), entries), entries, timeout=TIMEOUT_S)
        stream.send(tensors[ids_key(GROW)])
        connection = _blocked_connection(serving)
        stream.abort()
        _ended(connection)
        assert fleet_state(trained) == before
        assert channel.call("Push", declared(PushRequest(origin).to_meta(), tensors), tensors,
                            timeout=TIMEOUT_S)[0]["outcome"] == "applied"  # the channel reconnects
    finally:
        channel.close()


# --- property: random malformed sparse pushes and lookups ------------------------------------------------------

POOL = ids_on(TARGET, 40, stop=10_000)  # valid ids of the target shard for the growing table
DEFECTS = {  # each breaks a well-formed growing-table part in one way
    "ids-dtype": lambda ids, grads, draw: (ids.to(draw(st.sampled_from([torch.int32, torch.float32]))), grads),
    "ids-2d": lambda ids, grads, draw: (ids.reshape(-1, 1), grads),
    "count": lambda ids, grads, draw: (ids, torch.ones(ids.numel() + draw(st.sampled_from([-1, 1, 5])), DIM[GROW])),
    "dim": lambda ids, grads, draw: (ids, torch.ones(ids.numel(), DIM[GROW] + draw(st.sampled_from([-2, -1, 1])))),
    "duplicate": lambda ids, grads, draw: (torch.cat([ids, ids[-1:]]), torch.ones(ids.numel() + 1, DIM[GROW])),
    "other-shard": lambda ids, grads, draw: (torch.cat([ids, THEIRS]), torch.ones(ids.numel() + 1, DIM[GROW])),
}


@st.composite
def malformed_sparse_pushes(draw) -> tuple[str, dict[str, torch.Tensor]]:
    count = draw(st.integers(1, 8))
    ids = POOL[torch.tensor(draw(st.lists(st.integers(0, len(POOL) - 1), min_size=count, max_size=count,
                                          unique=True)))]
    grads = torch.tensor(draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=count * DIM[GROW],
                                       max_size=count * DIM[GROW]))).reshape(count, DIM[GROW])
    defect = draw(st.sampled_from(sorted(DEFECTS)))
    ids, grads = DEFECTS[defect](ids, grads, draw)
    tensors = rows_push(GROW, ids, grads)
    if draw(st.booleans()):  # a well-formed second table beside it: the whole push is refused all the same
        tensors.update(rows_push(FIXED, MINE[:draw(st.integers(1, 3))]))
    if draw(st.booleans()):
        tensors["v"] = torch.ones(3)
    return defect, tensors


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=malformed_sparse_pushes())
def test_random_malformed_sparse_pushes_are_refused_and_change_nothing(trained, request):
    defect, tensors = request
    origin = next_origin()
    with still_serving(trained, origin):
        with pytest.raises(InvalidArgumentError):
            trained.channel.call("Push", declared(PushRequest(origin).to_meta(), tensors), tensors, timeout=TIMEOUT_S)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(table=st.sampled_from([GROW, FIXED, "nope"]), dtype=st.sampled_from([torch.int64, torch.int32, torch.float32]),
       shape=st.sampled_from([(3,), (3, 1), ()]), foreign=st.booleans())
def test_random_lookups_are_answered_or_refused_and_change_nothing(trained, table, dtype, shape, foreign):
    ids = (torch.cat([MINE[:2], THEIRS]) if foreign else MINE).to(dtype)
    ids = ids[0] if shape == () else ids.reshape(shape)
    valid = table != "nope" and dtype == torch.int64 and shape == (3,) and not foreign
    with still_serving(trained, next_origin()):
        if valid:
            _, rows = trained.channel.call("Lookup", {}, {table: ids}, timeout=TIMEOUT_S)
            assert rows[table].shape == (3, DIM[table])
        else:
            with pytest.raises(InvalidArgumentError):
                trained.channel.call("Lookup", {}, {table: ids}, timeout=TIMEOUT_S)
