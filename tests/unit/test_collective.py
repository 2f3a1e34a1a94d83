"""worker/collective.py's generations: who forms a group, over torch's own in-memory store (HashStore)."""

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from tensorfleet.worker.collective import GENERATION_KEY, generation_after, join_generation, waiting_to_join


def _store() -> dist.Store:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    return store


def _join_all(store, replicas, expected, window_s, **kwargs):
    results = {}

    def join(replica):
        results[replica] = join_generation(store, replica, expected, window_s, time.monotonic() + 10,
                                           incarnation=f"first-{replica}", **kwargs)

    threads = [threading.Thread(target=join, args=(r,)) for r in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return results


def test_at_the_start_every_worker_is_a_member_of_generation_0():
    assert _join_all(_store(), [0, 1, 2], 3, 5.0) == {r: (0, [0, 1, 2]) for r in range(3)}


def test_after_a_death_the_survivors_that_arrive_in_the_window_form_the_next_group():
    store = _store()
    _join_all(store, [0, 1, 2], 3, 5.0)
    deadline = time.monotonic() + 10
    assert [generation_after(store, 0, deadline) for _ in range(2)] == [1, 1]  # moved on once, not twice
    started = time.monotonic()
    assert _join_all(store, [0, 2], 3, 0.3) == {0: (1, [0, 2]), 2: (1, [0, 2])}
    assert time.monotonic() - started < 5  # the window, not the deadline


def test_a_restarted_worker_waits_for_the_group_to_move_then_joins_it():
    store = _store()
    _join_all(store, [0, 1], 2, 5.0)
    generation_after(store, 0, time.monotonic() + 10)
    _join_all(store, [0], 2, 0.2)  # worker 1 died: worker 0 alone in generation 1
    late = {}
    thread = threading.Thread(target=lambda: late.update(r=join_generation(store, 1, 2, 5.0, time.monotonic() + 10,
                                                                           incarnation="second-1")))
    thread.start()
    deadline = time.monotonic() + 5
    while not waiting_to_join(store, 1):  # the running group sees it waiting (its first rank asks each second)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert thread.is_alive() and store.add(GENERATION_KEY, 0) == 1  # it waits for the group, not alone
    generation_after(store, 1, time.monotonic() + 10)  # the group moves at a step boundary
    assert _join_all(store, [0], 2, 5.0) == {0: (2, [0, 1])}
    thread.join(10)
    assert late == {"r": (2, [0, 1])}


def test_a_restarted_worker_never_joins_the_running_group_its_first_incarnation_was_in():
    """Restarted before the others noticed the death: its replica id is in generation 0, but not this
    incarnation; with the others done (no group will move), it forms one alone."""
    store = _store()
    _join_all(store, [0, 1], 2, 5.0)
    assert join_generation(store, 1, 2, 0.2, time.monotonic() + 10, incarnation="second-1",
                           others_done=lambda: True) == (1, [1])
