"""Tables that evict while two async workers push through real ps servers: within bounds, every update once.

Each push carries 8 hot ids (both workers, every step) and 12 cold ids seen once. The hot rows are always
the most recently updated, so eviction (a capacity per shard, or the ps's memory budget) takes cold rows
only; with SGD at lr 1 and a gradient of 1, a hot row's value is minus the number of pushes that carried
it: any update lost or applied twice would show.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.testing.models import run_workers
from tensorfleet.worker.embedding import EmbeddingTable
from tensorfleet.worker.replica import Replica

pytestmark = pytest.mark.cluster
STEPS, WORKERS, DIM = 150, 2, 4
HOT = torch.tensor([3, -9, 2 ** 40, 17, 123_456, -(2 ** 50), 8, 99])


def cold(worker: int, step: int) -> torch.Tensor:
    return torch.arange(12) + 1_000_000 * (1 + worker) + 100 * step


def train(cluster, table_options: dict, watch) -> None:
    def body(worker: int) -> None:
        table = EmbeddingTable("t", DIM, optimizer=OptimizerSpec("sgd", {"lr": 1.0}),
                               initializer=RowInitializer.constant(0.0), **table_options)
        model = torch.nn.ModuleDict({"t": table})
        with Replica(model, cluster, TaskSpec("worker", worker), optimizer=OptimizerSpec.sgd(lr=1.0)) as replica:
            for step in range(STEPS):
                table(torch.cat([HOT, cold(worker, step)])).sum().backward()
                replica.push()
                watch()

    run_workers(WORKERS, body, timeout_s=120)


def check_hot_rows_and_counts(servers) -> None:
    rows = {}
    for server in servers:
        state = server.store.snapshot().tables["t"]
        rows.update(zip(state.ids.tolist(), state.values[:, 0].tolist()))
    for hot in HOT.tolist():
        assert rows[hot] == -WORKERS * STEPS, f"row {hot}: {rows[hot]}, expected {-WORKERS * STEPS}"
    statuses = [server.status()["tables"]["t"] for server in servers]
    created = sum(s["rows_created"] for s in statuses)
    assert created == len(HOT) + WORKERS * STEPS * 12  # every cold id once: none created twice
    assert created - sum(s["evicted"] for s in statuses) == sum(s["rows"] for s in statuses)
    assert sum(s["row_updates"] for s in statuses) == WORKERS * STEPS * (len(HOT) + 12)


def test_a_capacity_per_shard_holds_under_async_pushes_and_no_update_is_lost_or_doubled():
    with ps_servers(num_ps=2, num_workers=WORKERS) as (cluster, servers):
        most = [0]
        lock = threading.Lock()

        def watch() -> None:
            with lock:
                most[0] = max([most[0]] + [s.status()["tables"]["t"]["rows"] for s in servers])

        train(cluster, {"max_rows": 64}, watch)
        assert most[0] <= 64
        check_hot_rows_and_counts(servers)
        assert all(s.status()["tables"]["t"]["evicted"] > 0 for s in servers)


def test_the_ps_memory_budget_holds_under_async_pushes_and_no_update_is_lost_or_doubled():
    budget = 60 * 1024
    with ps_servers(num_ps=2, num_workers=WORKERS, memory_budget=budget) as (cluster, servers):
        most = [0]
        lock = threading.Lock()

        def watch() -> None:
            with lock:
                most[0] = max([most[0]] + [s.status()["tables"]["t"]["bytes"] for s in servers])

        train(cluster, {}, watch)
        assert 0 < most[0] <= budget
        check_hot_rows_and_counts(servers)
        assert all(s.status()["tables"]["t"]["evicted"] > 0 for s in servers)
