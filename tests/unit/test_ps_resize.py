"""The ps side of scaling an asynchronous job, without a socket: Resize sets the membership, Done counts against it.

The job's replicas are 0..N-1; a ps finishes when all of them said Done.  A grow makes the ps wait for
the new ones (and take their pushes); a shrink forgets the Done of the ids it removes, so an id that
comes back is a new worker.
"""

from __future__ import annotations

import pytest
import torch

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.specs import OptimizerSpec, SyncOptions
from tensorfleet.protocol.messages import DoneRequest, MAX_REPLICAS, Origin, PushRequest, ResizeRequest
from tensorfleet.ps.service import PsService
from tensorfleet.ps.store import VariableStore

SGD = OptimizerSpec.sgd(lr=0.5)


def service(workers: int, sync: SyncOptions | None = None) -> PsService:
    store = VariableStore(task="/job:ps/task:0", replica_names=[f"/job:worker/task:{i}" for i in range(workers)])
    store.initialize({"w": torch.zeros(3)}, SGD, sync)
    return PsService(store)


def done(ps: PsService, replica: int) -> dict:
    return ps.done(DoneRequest(replica).to_meta(), {})[0]


def resize(ps: PsService, replicas: int) -> dict:
    return ps.resize(ResizeRequest(replicas).to_meta(), {})[0]


def push_from(ps: PsService, worker: int) -> None:
    ps.store.push(PushRequest(Origin(worker, 1, 1), advance_step=True), {"w": torch.ones(3)})


def test_a_grown_ps_takes_the_new_workers_pushes_and_waits_for_their_done():
    ps = service(2)
    with pytest.raises(InvalidArgumentError, match="the job's replicas are 0..1"):
        push_from(ps, 2)
    assert resize(ps, 3) == {"num_workers": 3, "workers_done": 0, "finished": False}
    push_from(ps, 2)
    assert ps.store.read()[1] == 1
    done(ps, 0)
    done(ps, 1)
    assert not ps.finished.is_set()  # before the resize, this was the end
    assert done(ps, 2) == {"workers_done": 3, "num_workers": 3}
    assert ps.finished.is_set()
    assert ps.status({}, {})[0]["done_replicas"] == [0, 1, 2]


def test_a_shrink_forgets_the_removed_workers_done_so_a_returning_index_is_a_new_worker():
    ps = service(3)
    done(ps, 2)
    done(ps, 1)  # scaled down: the leavers said Done; worker 0 trains on
    assert resize(ps, 1) == {"num_workers": 1, "workers_done": 0, "finished": False}
    assert ps.status({}, {})[0]["done_replicas"] == []
    with pytest.raises(InvalidArgumentError, match="must be in 0..0"):
        done(ps, 1)  # no longer a replica of the job
    resize(ps, 2)  # worker 1 again: a new process
    push_from(ps, 1)
    done(ps, 0)
    assert not ps.finished.is_set()  # its earlier Done does not count for the new worker 1
    done(ps, 1)
    assert ps.finished.is_set()


def test_a_shrink_finishes_a_ps_whose_remaining_workers_are_all_done():
    ps = service(3)
    done(ps, 0)
    assert resize(ps, 1)["finished"] and ps.finished.is_set()


def test_a_finished_ps_stays_finished_and_unchanged():
    ps = service(1)
    done(ps, 0)
    assert resize(ps, 4) == {"num_workers": 1, "workers_done": 1, "finished": True}
    assert ps.num_workers == 1 and ps.store.membership.count == 1


def test_a_shrink_forgets_the_removed_workers_latest_push_and_names_new_ones():
    ps = service(2)
    push_from(ps, 1)
    resize(ps, 1)
    assert 1 not in ps.store._origins.cut(0).applied
    resize(ps, 3)
    assert ps.store.membership.names == ["/job:worker/task:0", "/job:worker/task:1", "/job:worker/task:2"]


def test_a_sync_ps_cannot_be_resized():
    ps = service(2, SyncOptions(2, 2))
    with pytest.raises(InvalidArgumentError, match="sync mode.*fixed number of replicas"):
        resize(ps, 3)
    assert resize(ps, 2)["num_workers"] == 2  # the same count changes nothing: fine
    assert ps.num_workers == 2


@pytest.mark.parametrize("meta, tensors, says", [
    ({}, {}, "Resize 'replicas' must be an integer from 1"),
    ({"replicas": 0}, {}, "got 0"),
    ({"replicas": True}, {}, "got True"),
    ({"replicas": "3"}, {}, "got '3'"),
    ({"replicas": MAX_REPLICAS + 1}, {}, f"got {MAX_REPLICAS + 1}"),
    ({"replicas": 3}, {"w": torch.ones(1)}, "a Resize carries no tensors"),
])
def test_a_malformed_resize_is_refused_and_changes_nothing(meta, tensors, says):
    ps = service(2)
    with pytest.raises(InvalidArgumentError, match=says):
        ps.resize(meta, tensors)
    assert ps.num_workers == 2 and ps.store.membership.count == 2


def test_resize_round_trips_through_its_meta():
    assert ResizeRequest.from_meta(ResizeRequest(5).to_meta()) == ResizeRequest(5)
