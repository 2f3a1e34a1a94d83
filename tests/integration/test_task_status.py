"""Every task answers Status: a ps from its store, a worker from what its training loop records."""

import json
import os

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.protocol.status import PsStatus, WorkerStatus
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

        def answer(**options) -> WorkerStatus:  # read strictly: a field of the wrong type fails the test
            return WorkerStatus.from_meta(channel.call("Status", timeout=10, **options)[0])

        try:
            assert answer(wait_for_ready=True).state == "starting"
            model = nn.Linear(3, 1)
            with tfl.Replica(model, cluster, task, optimizer=tfl.OptimizerSpec.sgd(lr=0.1)) as replica:
                replica.report(target_step=50)
                for _ in range(3):
                    replica.pull()
                    loss = model(torch.ones(4, 3)).sum()
                    loss.backward()
                    replica.push()
                    replica.report(loss=loss.item(), examples=4)
                said = answer()
            assert said.task == "/job:worker/task:0" and said.role == "chief" and said.state == "training"
            assert said.local_step == 3 and said.global_step == 3 and said.examples == 12
            assert said.target_step == 50 and said.loss == loss.item() and said.pid == os.getpid()
            assert said.last_step_age_s is not None and said.last_step_age_s >= 0
            assert answer().state == "done"  # finish() on leaving the block
            ps_said = PsStatus.from_meta(Channel(cluster.ps_addresses[0], task="ps").call("Status", timeout=10)[0])
            assert ps_said.role == "ps" and ps_said.global_step == 3 and ps_said.pid == os.getpid()
        finally:
            channel.close()
            server.stop(0)
        monkeypatch.setenv("TENSORFLEET_STATUS_DIR", str(tmp_path))
        write_final_status(task, status.as_meta())
        final = WorkerStatus.from_meta(json.loads(final_status_path(tmp_path, task).read_text()))
        assert final.local_step == 3 and final.state == "done"


def test_a_worker_whose_port_is_taken_trains_without_a_status_endpoint():
    with ps_servers(num_ps=1, num_workers=1) as (cluster, _servers):
        task = TaskSpec("worker", 0)
        first = serve_status(cluster, task, TaskStatus())
        try:
            assert serve_status(cluster, task, TaskStatus()) is None  # warned, not raised
        finally:
            first.stop(0)
