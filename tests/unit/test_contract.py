"""The worker <-> ps contract (ps/api.py) and the service that speaks it, without a socket.

Requests round-trip through their wire meta; malformed fields are refused naming the method
and the field; a push is one store transaction, validated once, before its body is read.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tensorfleet.errors import InvalidArgumentError, NotInitializedError
from tensorfleet.ps import layout as layout_module
from tensorfleet.protocol.specs import Mode, OptimizerSpec, SyncOptions
from tensorfleet.protocol.messages import (DoneRequest, InitRequest, Origin, Outcome, PullRequest, PushReply,
                                           PushRequest, grads_key, ids_key, tables_named)
from tensorfleet.ps.service import PsService
from tensorfleet.ps.store import VariableStore

SGD = OptimizerSpec.sgd(lr=0.5)


@pytest.mark.parametrize("request_", [
    InitRequest(SGD), InitRequest(OptimizerSpec.adam(lr=0.01), SyncOptions(2, 3, 10.0), 0.99, "apply"),
    InitRequest(SGD, restore=(7, 9), force=True),
    PullRequest(), PullRequest(averages=True, wire_dtype=torch.bfloat16),
    PushRequest(Origin(1, 5, 3), with_values=True, advance_step=True),
    PushRequest(Origin(0, 1, 1), wire_dtype=torch.float16, replica=1, step=4), PushRequest(),
    DoneRequest(2),
])
def test_every_request_round_trips_through_its_meta(request_):
    assert type(request_).from_meta(request_.to_meta()) == request_


def test_the_mode_of_a_push_is_whether_it_names_a_step():
    assert PushRequest(step=0, replica=0).mode is Mode.SYNC and PushRequest().mode is Mode.ASYNC
    assert InitRequest(SGD, SyncOptions(1, 1)).mode is Mode.SYNC and InitRequest(SGD).mode is Mode.ASYNC
    assert PushReply.from_meta({"step": 3, "outcome": "stale"}).outcome.dropped
    assert not Outcome.RETRIED.dropped and f"{Mode.SYNC}" == "sync"


@pytest.mark.parametrize("cls, meta, says", [
    (PushRequest, {"values": "yes"}, "Push 'values' must be a bool"),
    (PushRequest, {"step": -1, "replica": 0}, "Push 'step' must be a non-negative integer"),
    (PushRequest, {"step": 1}, "Push 'replica' must be a non-negative integer"),
    (PushRequest, {"origin": [1, 2]}, "Push 'origin' must be [worker, incarnation, seq]"),
    (PushRequest, {"wire_dtype": "int8"}, "'wire_dtype' 'int8' is not one of"),
    (PushRequest, {"advance_step": 1}, "Push 'advance_step' must be a bool"),
    (PullRequest, {"averages": 0}, "Pull 'averages' must be a bool"),
    (DoneRequest, {"replica": True}, "Done 'replica' must be a non-negative integer"),
    (InitRequest, {"optimizer": {"name": "lbfgs"}}, "unknown optimizer 'lbfgs'"),
    (InitRequest, {"optimizer": {"name": "sgd"}, "force": True}, "'force' must be a bool and needs 'restore'"),
    (InitRequest, {"optimizer": {"name": "sgd"}, "restore": [1, 2]}, "Init 'restore' must be an object"),
    (InitRequest, {"optimizer": {"name": "sgd"}, "nonfinite": "ignore"}, "Init 'nonfinite' must be one of"),
    (PushReply, {"step": 1, "outcome": "lost"}, "Push reply 'outcome' 'lost' is not one of"),
])
def test_a_malformed_field_is_refused_naming_the_method_and_the_field(cls, meta, says):
    with pytest.raises(InvalidArgumentError) as caught:
        cls.from_meta(meta)
    assert says in str(caught.value)


class FakeRequest:
    """A data-plane request as the service sees it: meta, announced entries, and a body read on demand."""

    def __init__(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.meta, self._tensors = meta, tensors
        self.entries = [SimpleNamespace(name=n, dtype=t.dtype, shape=tuple(t.shape)) for n, t in tensors.items()]
        self.body = None
        self.received = False

    def receive(self) -> dict[str, torch.Tensor]:
        self.received = True
        return dict(self._tensors)


def service(sync: SyncOptions | None = None) -> PsService:
    store = VariableStore(task="/job:ps/task:0", replica_names=["/job:worker/task:0"])
    store.initialize({"w": torch.zeros(3)}, SGD, sync)
    return PsService(store)


def test_a_push_is_validated_once_and_applied_in_one_transaction(monkeypatch):
    checks = []
    real = layout_module.check_layout
    monkeypatch.setattr(layout_module, "check_layout", lambda *a, **k: (checks.append(1), real(*a, **k))[1])
    ps = service()
    reply = ps.push(FakeRequest(PushRequest(Origin(0, 1, 1), with_values=True, advance_step=True).to_meta(),
                                {"w": torch.ones(3)}))
    assert PushReply.from_meta(reply.meta) == PushReply(1, Outcome.APPLIED)
    assert torch.equal(reply.tensors["w"], torch.full((3,), -0.5))
    reply.release()
    assert checks == [1]  # admitted before the body, never checked again


def test_a_push_with_rows_is_split_once_and_is_one_store_call(monkeypatch):
    from tensorfleet.protocol.specs import TableSpec

    store = VariableStore(task="/job:ps/task:0", replica_names=["/job:worker/task:0"])
    store.initialize({"w": torch.zeros(3)}, SGD, tables=(TableSpec("t", 4, SGD, num_rows=10),))
    ps = PsService(store)
    splits, calls = [], []
    real_split = PushRequest.split
    monkeypatch.setattr(PushRequest, "split", lambda self, tensors: (splits.append(1), real_split(self, tensors))[1])
    for name in ("admit", "push", "push_arriving", "lookup_arriving", "lookup"):
        method = getattr(store, name)
        monkeypatch.setattr(store, name, lambda *a, _m=method, _n=name, **k: (calls.append(_n), _m(*a, **k))[1])
    rows = {ids_key("t"): torch.tensor([1, 2]), grads_key("t"): torch.ones(2, 4)}
    reply = ps.push(FakeRequest(PushRequest(Origin(0, 1, 1), advance_step=True, tables=("t",)).to_meta(),
                                {"w": torch.ones(3), **rows}))
    assert PushReply.from_meta(reply.meta).outcome is Outcome.APPLIED
    assert splits == [1]  # told apart once, from the head, before the body
    assert calls[0] == "push_arriving" and calls.count("push_arriving") == 1
    calls.clear()
    looked = ps.lookup(FakeRequest({}, {"t": torch.tensor([2, 2, 7])}))
    assert calls[0] == "lookup_arriving"
    assert torch.equal(looked.tensors["t"][0], looked.tensors["t"][1]) and not torch.equal(
        looked.tensors["t"][0], torch.zeros(4))  # id 2 was updated, twice asked for: repeats are fine in a lookup


def test_a_lookup_is_checked_by_the_store_before_and_after_its_body():
    from tensorfleet.protocol.specs import TableSpec

    store = VariableStore(task="/job:ps/task:0", shard=(0, 2))
    store.initialize({"w": torch.zeros(3)}, SGD, tables=(TableSpec("t", 4, SGD, num_rows=10),))
    request = FakeRequest({}, {"u": torch.tensor([0])})
    with pytest.raises(InvalidArgumentError, match="'u' is no embedding table of this shard"):
        store.lookup_arriving({"u": (torch.int64, (1,))}, request.receive)
    assert not request.received  # refused from its head
    from tensorfleet.cluster.idhash import shard_of
    stray = next(i for i in range(100) if int(shard_of(torch.tensor([i]), 2)[0]) == 1)
    with pytest.raises(InvalidArgumentError, match=f"id {stray} lives on ps 1"):
        store.lookup_arriving({"t": (torch.int64, (1,))}, lambda: {"t": torch.tensor([stray])})


ROWS = {ids_key("t"): torch.tensor([1, 2]), grads_key("t"): torch.ones(2, 4)}  # a table this shard lacks


@pytest.mark.parametrize("meta, tensors, says", [
    (PushRequest(advance_step=True).to_meta(), {"v": torch.ones(3)}, "unknown variable 'v'"),
    (PushRequest(advance_step=True).to_meta(), {"w": torch.ones(4)}, "gradient for 'w' is torch.float32 \\(4,\\)"),
    (PushRequest(replica=0, step=0).to_meta(), {"w": torch.ones(3)}, "this ps runs in async mode"),
    # a table's rows only as the push declares them
    (PushRequest(advance_step=True).to_meta(), {"w": torch.ones(3), **ROWS},
     "'@grads/t' names no embedding table this push declares"),
    (PushRequest(advance_step=True, tables=("t",)).to_meta(), {"w": torch.ones(3), ids_key("t"): ROWS[ids_key("t")]},
     "table 't': a push carries both '@ids/t' and '@grads/t'"),
    (PushRequest(advance_step=True, tables=("t",)).to_meta(), {"w": torch.ones(3), **ROWS},
     "'@ids/t' names no embedding table of this shard"),
])
def test_a_bad_push_is_refused_before_its_body_is_read_and_changes_nothing(meta, tensors, says):
    ps = service()
    request = FakeRequest(meta, tensors)
    with pytest.raises(InvalidArgumentError, match=says):
        ps.push(request)
    assert not request.received
    values, step = ps.store.read()
    assert step == 0 and torch.equal(values["w"], torch.zeros(3))


def test_a_sync_push_missing_a_variable_is_refused_before_its_body():
    ps = service(SyncOptions(1, 1))
    ps.store.initialize({"w": torch.zeros(3), "b": torch.zeros(1)}, SGD, SyncOptions(1, 1), force=True,
                        restore=ps.store.snapshot())
    request = FakeRequest(PushRequest(replica=0, step=0).to_meta(), {"w": torch.ones(3)})
    with pytest.raises(InvalidArgumentError, match="must carry every variable"):
        ps.push(request)
    assert not request.received


def test_a_layout_replaced_between_admission_and_push_is_checked_again():
    ps = service()
    push = PushRequest(advance_step=True)
    admitted = ps.store.admit({"w": (torch.float32, (3,))}, push)
    ps.store.initialize({"w": torch.zeros(5)}, SGD, force=True, restore=_state({"w": torch.zeros(5)}))
    with pytest.raises(InvalidArgumentError, match="gradient for 'w' is torch.float32 \\(3,\\)"):
        ps.store.push(push, {"w": torch.ones(3)}, admitted)


def test_nothing_is_admitted_before_the_chief_initializes():
    store = VariableStore(task="/job:ps/task:0")
    with pytest.raises(NotInitializedError):
        store.admit({"w": (torch.float32, (3,))}, PushRequest())


def _state(values):
    from tensorfleet.protocol.state import ShardState
    return ShardState(values, {}, None, 0, 0)


@pytest.mark.parametrize("tables", ["t", ["t", "t"], ["bad name"], [1], ["t"] * 2000])
def test_a_push_declaring_tables_wrongly_is_refused(tables):
    with pytest.raises(InvalidArgumentError, match="Push 'tables' must be a list of distinct table names"):
        PushRequest.from_meta({**PushRequest(advance_step=True).to_meta(), "tables": tables})


def test_a_push_splits_its_tensors_by_the_tables_it_declares():
    push = PushRequest(advance_step=True, tables=("a", "b"))
    assert PushRequest.from_meta(push.to_meta()) == push
    tensors = {"w": 1, ids_key("a"): 2, grads_key("a"): 3, ids_key("b"): 4, grads_key("b"): 5}
    assert push.split(tensors) == ({"w": 1}, {"a": (2, 3), "b": (4, 5)})
    assert tables_named(tensors) == ("a", "b")
