"""A checkpoint is one consistent cut of the fleet (issue 30, item 3): every push is in every shard's state or in
none. The minimal job: two scalars on two ps, SGD lr 1, every push a gradient of 1 for both; while a worker pushes,
the chief takes snapshots. Before the fence 97 of 172 such checkpoints were torn (ps 1 after a push, ps 0 before
it); now none of hundreds is."""

from __future__ import annotations

import threading

import pytest
import torch

from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.worker.client import PsClient

pytestmark = pytest.mark.cluster
PLACEMENT = {"a": 0, "b": 1}  # one scalar on each ps
SAVES = 500


def pushing(cluster, replica: int, stop: threading.Event, pushes: list[int]) -> threading.Thread:
    client = PsClient(cluster, PLACEMENT)
    client.wait_for_shards(10)  # learns each shard's data port

    def run() -> None:
        try:
            while not stop.is_set():
                client.push({"a": torch.ones(1), "b": torch.ones(1)}, replica=replica)
                pushes[replica] += 1
        finally:
            client.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("workers", [1, 2])
def test_no_snapshot_of_two_shards_is_torn_while_workers_push(workers):
    with ps_servers(num_ps=2, num_workers=workers) as (cluster, servers):
        chief = PsClient(cluster, PLACEMENT)
        chief.wait_for_shards(10)
        chief.initialize({"a": torch.zeros(1), "b": torch.zeros(1)}, OptimizerSpec.sgd(lr=1.0))
        stop, pushes = threading.Event(), [0] * workers
        threads = [pushing(cluster, r, stop, pushes) for r in range(workers)]
        torn = []
        try:
            for _ in range(SAVES):
                a_state, b_state = chief.snapshot()
                a, b = float(a_state.values["a"]), float(b_state.values["b"])
                if a != b or a_state.applied_updates != b_state.applied_updates:
                    torn.append((a, b, a_state.applied_updates, b_state.applied_updates))
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
            chief.close()
        assert sum(pushes) > 100, pushes  # the pushes really ran beside the snapshots
        assert not torn, f"{len(torn)} of {SAVES} snapshots torn, e.g. {torn[:3]}"
