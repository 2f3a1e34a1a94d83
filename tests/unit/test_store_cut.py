"""A shard's part of a consistent cut (issue 30, item 3), in one process: a fence holds pushes until the chief's cut
lets them through; a sync shard a step behind another catches up to the cut before its copy; a forced restore with
a cut applies no push of the timeline it ends and every later one; a paged snapshot's pages are one point."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tensorfleet.ps.store as store_module
from tensorfleet.errors import InvalidArgumentError, TimelineChangedError
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer, SyncOptions, TableSpec
from tensorfleet.protocol.messages import (Cut, FenceRequest, Origin, Outcome, PushRequest, StepReply, grads_key,
                                           ids_key)
from tensorfleet.ps.store import VariableStore

SGD = OptimizerSpec.sgd(lr=1.0)
INCARNATION = time.time_ns()


def async_store(replicas: int = 2) -> VariableStore:
    store = VariableStore(task="/job:ps/task:0", replica_names=[f"/job:worker/task:{i}" for i in range(replicas)])
    store.initialize({"x": torch.zeros(1)}, SGD)
    return store


def push_in_thread(store: VariableStore, request: PushRequest) -> tuple[threading.Thread, list]:
    replies: list = []
    thread = threading.Thread(target=lambda: replies.append(store.push(request, {"x": torch.ones(1)}).reply),
                              daemon=True)
    thread.start()
    return thread, replies


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def held(store: VariableStore) -> int:
    with store._cond:
        return len(store._fence.held) if store._fence is not None else 0


def test_a_fence_holds_pushes_until_its_cut_and_lets_the_later_ones_go_after_the_copy():
    store = async_store()
    store.push(PushRequest(origin=Origin(0, INCARNATION, 1)), {"x": torch.ones(1)})
    cut = store.fence()
    assert cut.applied == {0: (INCARNATION, 1)} and cut.step == 0
    in_cut, in_cut_replies = push_in_thread(store, PushRequest(origin=Origin(1, INCARNATION, 1)))
    later, later_replies = push_in_thread(store, PushRequest(origin=Origin(0, INCARNATION, 2)))
    wait_until(lambda: held(store) == 2)
    # another shard applied worker 1's push 1 before its fence: it is in the cut, so it goes through here first
    state = store.snapshot(cut=cut.merge(Cut({1: (INCARNATION, 1)})))
    assert float(state.values["x"]) == -2.0 and state.applied_updates == 2  # worker 0's first, worker 1's
    for thread in (in_cut, later):
        thread.join(10)
    assert in_cut_replies[0].outcome is later_replies[0].outcome is Outcome.APPLIED
    assert float(store.read()[0]["x"]) == -3.0  # the later push, let go after the copy


def test_a_restore_with_a_cut_applies_no_push_of_the_old_timeline_and_every_later_one():
    """The chief fenced the live shards: worker 0's push 2 had reached another shard (its cut entry), worker 1's
    push 1 none. Held here across the restore, the first is counted as seen (not applied), the second applied."""
    store = async_store()
    checkpoint = store.snapshot()
    store.push(PushRequest(origin=Origin(0, INCARNATION, 1)), {"x": torch.ones(1)})
    cut = store.fence().merge(Cut({0: (INCARNATION, 2)}))
    old, old_replies = push_in_thread(store, PushRequest(origin=Origin(0, INCARNATION, 2)))
    new, new_replies = push_in_thread(store, PushRequest(origin=Origin(1, INCARNATION, 1)))
    wait_until(lambda: held(store) == 2)
    assert store.initialize({"x": torch.zeros(1)}, SGD, restore=checkpoint, force=True, cut=cut)
    for thread in (old, new):
        thread.join(10)
    assert old_replies[0].outcome is Outcome.RETRIED and new_replies[0].outcome is Outcome.APPLIED
    assert float(store.read()[0]["x"]) == -1.0  # the checkpoint's 0, and worker 1's push only


def test_a_push_computed_on_an_earlier_epoch_is_refused_after_a_restore():
    """Issue 42: a restore starts a new epoch; a push naming the one before (held across the restore, or sent
    after it from values pulled before) is refused, whatever its origin, and one naming the new epoch applied."""
    store = async_store()
    before = store.epoch
    store.push(PushRequest(origin=Origin(0, INCARNATION, 1), epoch=before), {"x": torch.ones(1)})
    checkpoint = store.snapshot()  # x == -1
    store.initialize(checkpoint.values, SGD, restore=checkpoint, force=True)
    assert store.epoch != before
    with pytest.raises(TimelineChangedError, match="restored since"):
        store.push(PushRequest(origin=Origin(1, INCARNATION, 1), epoch=before), {"x": torch.ones(1)})
    assert float(store.read()[0]["x"]) == -1.0 and store.status().accepted_pushes == 0
    store.push(PushRequest(origin=Origin(1, INCARNATION, 1), epoch=store.epoch), {"x": torch.ones(1)})
    assert float(store.read()[0]["x"]) == -2.0


def test_a_fence_released_lets_its_held_pushes_go_at_once_and_a_cut_fence_is_not_lifted():
    """Issue 42: a save that failed on another shard releases this one's fence, rather than hold pushes 5 s."""
    store = async_store()
    store.fence(hold_s=30)
    thread, replies = push_in_thread(store, PushRequest(origin=Origin(0, INCARNATION, 1)))
    wait_until(lambda: held(store) == 1)
    assert store.release_fence()
    thread.join(5)
    assert replies[0].outcome is Outcome.APPLIED and not store.release_fence()  # nothing left to lift
    cut = store.fence(hold_s=30)
    with store._cond:
        store._fence.cut = cut  # a snapshot at its cut holds it: that fence ends with the snapshot only
    assert not store.release_fence()


def test_the_epoch_and_the_release_travel():
    assert FenceRequest.from_meta(FenceRequest(release=True).to_meta()).release
    assert not FenceRequest.from_meta(FenceRequest().to_meta()).release
    push = PushRequest(origin=Origin(0, 1, 2), epoch="abc.3")
    assert PushRequest.from_meta(push.to_meta()).epoch == "abc.3"
    assert PushRequest.from_meta(PushRequest().to_meta()).epoch is None
    assert StepReply.from_meta(StepReply(4, "abc.3").to_meta()) == StepReply(4, "abc.3")
    with pytest.raises(InvalidArgumentError, match="epoch"):
        PushRequest.from_meta({**push.to_meta(), "epoch": 7})


def test_a_fence_expires_when_no_cut_comes():
    store = async_store()
    store.fence(hold_s=0.2)
    started = time.monotonic()
    assert store.push(PushRequest(origin=Origin(0, INCARNATION, 1)), {"x": torch.ones(1)}).reply.outcome \
        is Outcome.APPLIED
    assert 0.15 < time.monotonic() - started < 5


def test_a_sync_shard_one_step_behind_reaches_the_cut_before_its_copy_and_goes_no_further():
    """Backup workers (2 of 3 aggregated): shard 0 aggregated step 0; shard 1 has one of its two gradients when
    the chief fences. The cut's step is 1: shard 1 lets replica 1's held step-0 push through, copies at step 1,
    and holds replica 2's step-1 push until after the copy."""
    sync = SyncOptions(replicas_to_aggregate=2, total_num_replicas=3, timeout_s=30)
    shards = []
    for index in range(2):
        shard = VariableStore(task=f"/job:ps/task:{index}", replica_names=[f"/job:worker/task:{i}" for i in range(3)],
                              shard=(index, 2))
        shard.initialize({"x": torch.zeros(1)}, SGD, sync=sync)
        shards.append(shard)

    def offer(shard: VariableStore, replica: int, step: int):
        return push_in_thread(shard, PushRequest(origin=Origin(replica, INCARNATION, step + 1), replica=replica,
                                                 step=step))

    pending = [offer(shards[0], 0, 0), offer(shards[0], 1, 0), offer(shards[1], 0, 0)]
    wait_until(lambda: shards[0].status().global_step == 1 and len(shards[1]._sync.contributors) == 1)
    cut = shards[0].fence().merge(shards[1].fence())
    assert cut.step == 1
    behind = offer(shards[1], 1, 0)
    ahead = offer(shards[1], 2, 1)
    wait_until(lambda: held(shards[1]) == 2)
    state = shards[1].snapshot(cut=cut)
    assert state.global_step == 1 and float(state.values["x"]) == -1.0  # step 0's mean, not step 1
    for thread, _ in pending + [behind, ahead]:
        thread.join(0.1)
    assert ahead[0].is_alive()  # let go after the copy; waits for a second gradient of step 1 now
    offer(shards[1], 0, 1)[0].join(10)
    ahead[0].join(10)
    assert shards[1].status().global_step == 2


def test_a_paged_snapshot_is_one_point_and_its_pages_are_read_once(monkeypatch):
    monkeypatch.setattr(store_module, "SNAPSHOT_PAGE_BYTES", 2_000)
    store = VariableStore(task="/job:ps/task:0")
    store.initialize({"x": torch.zeros(1)}, SGD, tables=[TableSpec("t", 4, SGD, initializer=RowInitializer.constant(0.0))])
    ids = torch.arange(500)
    update = {"x": torch.ones(1), ids_key("t"): ids, grads_key("t"): torch.ones(500, 4)}
    store.apply(update, advance_step=True)
    first = store.snapshot()
    assert first.pages > 3 and first.token
    store.apply(update, advance_step=True)  # after page 0 was taken: in none of its pages
    pages = [store.snapshot(page=p, pages=first.pages, token=first.token) for p in range(1, first.pages)]
    rows = torch.cat([first.tables["t"].values] + [p.tables["t"].values for p in pages])
    assert rows.shape[0] == 500 and bool((rows == -1.0).all())  # every row as after the first update
    assert float(first.values["x"]) == -1.0 and first.applied_updates == 1
    with pytest.raises(InvalidArgumentError, match="not kept here"):
        store.snapshot(page=1, pages=first.pages, token=first.token)  # each page is given once
    with pytest.raises(InvalidArgumentError, match="not kept here"):
        store.snapshot(page=1, pages=first.pages, token="another")
