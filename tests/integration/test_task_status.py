"""Every task answers Status: a ps from its store, a worker from what its training loop records."""

import os

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.wire.rpc import Channel
from tensorfleet.worker.status import TaskStatus, final_status_path, serve_status, write_final_status


def test_worker_status_reports_steps_loss_examples_and_target(monkeypatch, tmp_path):
    with ps_servers(num_ps=1, num_workers=1) as (cluster, _servers):
        task = TaskSpec("worker", 0)
        status = TaskStatus()
        monkeypatch.setattr("tensorfleet.worker.replica.PROCESS_STATUS", status)
        server = serve_status(cluster, task, status)
        channel = Channel(cluster.task_address("worker", 0), task=task.name)
        try:
            assert channel.call("Status", timeout=10, wait_for_ready=True)[0]["state"] == "starting"
            model = nn.Linear(3, 1)
            with tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.sgd(lr=0.1)) as replica:
                replica.report(target_step=50)
                for _ in range(3):
                    replica.pull()
                    loss = model(torch.ones(4, 3)).sum()
                    loss.backward()
                    replica.push()
                    replica.report(loss=loss.item(), examples=4)
                meta = channel.call("Status", timeout=10)[0]
            assert meta["task"] == "/job:worker/task:0" and meta["role"] == "chief" and meta["state"] == "training"
            assert meta["local_step"] == 3 and meta["global_step"] == 3 and meta["examples"] == 12
            assert meta["target_step"] == 50 and meta["loss"] == loss.item() and meta["pid"] == os.getpid()
            assert meta["last_step_age_s"] >= 0
            assert channel.call("Status", timeout=10)[0]["state"] == "done"  # finish() on leaving the block
            ps_meta = Channel(cluster.ps_addresses[0], task="ps").call("Status", timeout=10)[0]
            assert ps_meta["role"] == "ps" and ps_meta["global_step"] == 3 and ps_meta["pid"] == os.getpid()
        finally:
            channel.close()
            server.stop(0)
        monkeypatch.setenv("TENSORFLEET_STATUS_DIR", str(tmp_path))
        write_final_status(task, status.as_meta())
        assert '"local_step": 3' in final_status_path(tmp_path, task).read_text()


def test_a_worker_whose_port_is_taken_trains_without_a_status_endpoint():
    with ps_servers(num_ps=1, num_workers=1) as (cluster, _servers):
        task = TaskSpec("worker", 0)
        first = serve_status(cluster, task, TaskStatus())
        try:
            assert serve_status(cluster, task, TaskStatus()) is None  # warned, not raised
        finally:
            first.stop(0)
