"""A worker whose ps never starts says what it waits for while it waits, then gives up naming it."""

from __future__ import annotations

import logging

import pytest

from tensorfleet.errors import DeadlineExceededError
from tensorfleet.cluster.ports import local_cluster
from tensorfleet.worker import client as client_module
from tensorfleet.worker.client import PsClient


def test_a_worker_waiting_for_a_ps_that_never_starts_says_so_while_it_waits(monkeypatch, caplog):
    monkeypatch.setattr(client_module, "WAIT_SAY_S", 1.0)
    monkeypatch.setattr(client_module, "STATUS_ATTEMPT_S", 0.5)
    cluster = local_cluster(1, 1)  # free ports: nothing listens at the ps's
    client = PsClient(cluster, {"w": 0})
    try:
        with caplog.at_level(logging.WARNING, logger=client_module.__name__):
            with pytest.raises(DeadlineExceededError, match="waited 4 s for ps /job:ps/task:0"):
                client.wait_for_shards(timeout_s=4.0)
    finally:
        client.close()
    said = [r.getMessage() for r in caplog.records if "still waiting for ps" in r.getMessage()]
    assert 2 <= len(said) <= 6, said  # about every WAIT_SAY_S, not every attempt
    assert cluster.task_address("ps", 0) in said[0] and "giving up after 4 s" in said[0]
