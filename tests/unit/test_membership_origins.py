"""The job's membership and the exactly-once bookkeeping of a ps shard, each kept in one place (issue 30, item 2)."""

from __future__ import annotations

import time

import pytest

from tensorfleet.errors import InvalidArgumentError, StaleIncarnationError
from tensorfleet.protocol.messages import Cut, Origin
from tensorfleet.ps.membership import Membership
from tensorfleet.ps.origins import MAX_INCARNATION_AHEAD_S, Origins

NOW = time.time_ns()


def admit(origins: Origins, worker: int, incarnation: int, seq: int) -> bool:
    return origins.admit(Origin(worker, incarnation, seq), name=lambda w: f"worker {w}", task="ps:0")


def test_a_replica_says_done_once_and_only_a_replica_of_the_job_may():
    members = Membership(["/job:chief/task:0", "/job:worker/task:0"])
    assert members.say_done(1) and not members.say_done(1)
    assert members.done == [1] and not members.all_done
    with pytest.raises(InvalidArgumentError, match=r"must be in 0\.\.1, got 2"):
        members.say_done(2)
    assert members.say_done(0) and members.all_done


def test_a_resize_names_new_workers_after_the_chief_and_forgets_the_removed_ones():
    members = Membership(["/job:chief/task:0", "/job:worker/task:0"])
    members.say_done(1)
    members.resize(1)
    assert members.done == [] and members.names == ["/job:chief/task:0"]
    members.resize(3)
    assert members.names == ["/job:chief/task:0", "/job:worker/task:0", "/job:worker/task:1"]
    assert members.knows(2) and not members.knows(3) and Membership().knows(99)


def test_a_push_is_taken_once_and_an_older_incarnation_is_refused():
    origins = Origins()
    assert admit(origins, 0, NOW, 1) and not admit(origins, 0, NOW, 1) and admit(origins, 0, NOW, 2)
    assert admit(origins, 0, NOW + 1, 1)  # a restarted process starts its numbers again
    with pytest.raises(StaleIncarnationError, match="old incarnation of worker 0"):
        admit(origins, 0, NOW, 3)
    with pytest.raises(InvalidArgumentError, match="ahead of this ps's clock"):
        admit(origins, 1, time.time_ns() + int((MAX_INCARNATION_AHEAD_S + 60) * 1e9), 1)


def test_a_restores_cut_counts_its_pushes_as_seen_and_a_resize_forgets_removed_workers():
    origins = Origins()
    admit(origins, 0, NOW, 5)
    origins.count_as_seen(Cut({0: (NOW, 3), 1: (NOW, 7)}))
    assert origins.cut(4) == Cut({0: (NOW, 5), 1: (NOW, 7)}, 4)  # never moved back
    assert not admit(origins, 1, NOW, 7) and admit(origins, 1, NOW, 8)
    origins.forget_from(1)
    assert origins.cut(0).applied == {0: (NOW, 5)} and admit(origins, 1, NOW, 1)
