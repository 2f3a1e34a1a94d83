"""How a ps ends: its Status says who is done, it says what each shard counted, and it can linger."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from tensorfleet.errors import UnavailableError
from tensorfleet.protocol.specs import OptimizerSpec, SyncOptions
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.wire.rpc import Channel
from tensorfleet.worker.client import PsClient

VALUES = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
GRADS = {name: torch.ones_like(value) for name, value in VALUES.items()}


@pytest.fixture
def two_ps():
    with ps_servers(num_ps=2, num_workers=2) as (cluster, servers):
        client = PsClient(cluster, {"w": 0, "b": 1})
        client.wait_for_shards(10)
        yield cluster, servers, client
        client.close()


def exit_lines(caplog) -> dict[str, str]:
    return {record.getMessage().split(": ", 1)[0]: record.getMessage() for record in caplog.records
            if "worker(s) done; exiting" in record.getMessage()}


def test_status_tells_which_workers_are_done_and_when_the_ps_is(two_ps):
    _, servers, client = two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=0.1))
    assert servers[1].status()["state"] == "running" and servers[1].status()["done_replicas"] == []
    client.done(1)
    status = servers[1].status()
    assert (status["state"], status["done_replicas"], status["workers_done"]) == ("running", [1], 1)
    client.done(0)
    status = servers[1].status()
    assert (status["state"], status["done_replicas"], status["workers_done"]) == ("done", [0, 1], 2)


def test_each_shard_says_what_it_counted_in_async_mode(two_ps, caplog):
    _, servers, client = two_ps
    caplog.set_level(logging.INFO, logger="tensorfleet.ps.server")
    client.initialize(VALUES, OptimizerSpec.sgd(lr=0.1))
    for _ in range(3):
        client.push(GRADS)
    client.done(0)
    client.done(1)
    assert servers[0].join(timeout=5) and servers[1].join(timeout=5)
    lines = exit_lines(caplog)
    assert lines["/job:ps/task:0"].endswith(
        "all 2 worker(s) done; exiting (global_step=3, applied_updates=3, dropped_stale=0)")
    assert lines["/job:ps/task:1"].endswith(
        "all 2 worker(s) done; exiting (applied 3 updates; the global step is counted by ps:0)")


def test_each_shard_says_what_it_counted_in_sync_mode(two_ps, caplog):
    _, servers, client = two_ps
    caplog.set_level(logging.INFO, logger="tensorfleet.ps.server")
    client.initialize(VALUES, OptimizerSpec.sgd(lr=0.1),
                      sync=SyncOptions(replicas_to_aggregate=1, total_num_replicas=2))
    for step in range(2):
        client.push(GRADS, replica=0, sync_steps=[step, step])
    client.done(0)
    client.done(1)
    assert servers[0].join(timeout=5) and servers[1].join(timeout=5)
    lines = exit_lines(caplog)
    assert lines["/job:ps/task:0"].endswith("exiting (global_step=2, applied_updates=2, dropped_stale=0)")
    assert lines["/job:ps/task:1"].endswith(
        "exiting (shard_step=2, applied_updates=2, dropped_stale=0; ps:0's step is the global step)")


def test_a_finished_ps_answers_done_while_it_lingers_then_stops(two_ps):
    cluster, servers, client = two_ps
    client.initialize(VALUES, OptimizerSpec.sgd(lr=0.1))
    joined: list[float] = []
    joiner = threading.Thread(target=lambda: joined.append(servers[0].join(timeout=10, linger_s=1.0) and
                                                           time.monotonic()))
    joiner.start()
    channel = Channel(cluster.ps_addresses[0], task="/job:ps/task:0")
    try:
        client.done(0)
        client.done(1)
        finished = time.monotonic()
        assert channel.call("Status", timeout=5)[0]["state"] == "done"  # the job is over; ps:0 still answers
        joiner.join(timeout=10)
        assert joined and joined[0] - finished >= 0.9, "the ps stopped before its linger was over"
        with pytest.raises(UnavailableError):
            channel.call("Status", timeout=5)
    finally:
        channel.close()
        joiner.join(timeout=10)
