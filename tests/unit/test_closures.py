"""In-graph replication's messages: what a closure's arguments and results may be, and bad requests refused."""

from __future__ import annotations

import pytest
import torch

from tensorfleet.errors import ConfigError, InvalidArgumentError
from tensorfleet.launch.config import JobConfig
from tensorfleet.protocol.closures import PerWorker, RunReply, RunRequest, Trained, pack, unpack
from tensorfleet.testing.local_cluster import REPO


def test_values_travel_as_json_with_their_tensors_beside_and_per_worker_values_resolve_there():
    tensors: dict[str, torch.Tensor] = {}
    value = [1, 2.5, "x", None, True, torch.ones(2), {"w": torch.zeros(3), "n": [4]}, PerWorker("per_worker_0")]
    meta = pack(value, tensors, "arg")
    assert sorted(tensors) == ["arg/5", "arg/6/w"]
    back = unpack(meta, tensors, {"per_worker_0": "the worker's own"})
    assert back[:5] == [1, 2.5, "x", None, True] and back[7] == "the worker's own"
    assert torch.equal(back[5], torch.ones(2)) and torch.equal(back[6]["w"], torch.zeros(3))


@pytest.mark.parametrize(("value", "message"), [
    (object(), "a object cannot be sent"), (float("inf"), "does not travel as JSON"), ({1: 2}, "a dict cannot"),
    ([[[[[[[[[[1]]]]]]]]]], "nested deeper than 8"),
])
def test_what_cannot_travel_is_refused_naming_it(value, message):
    with pytest.raises(InvalidArgumentError, match=message):
        pack(value, {}, "arg")


def test_a_worker_refuses_references_it_cannot_resolve_and_malformed_requests():
    with pytest.raises(InvalidArgumentError, match="tensor 'arg/0' is named but not sent"):
        unpack({"$tensor": "arg/0"}, {})
    with pytest.raises(InvalidArgumentError, match="per-worker value 'data' is not kept on this worker"):
        unpack({"$per_worker": "data"}, {}, {})
    for meta, message in [({"function": "os.system('x')"}, "qualified name"), ({"function": 3}, "qualified name"),
                          ({"function": "f", "args": "x"}, "'args' must be a list"),
                          ({"function": "f", "args": list(range(65))}, "at most 64"),
                          ({"function": "f", "keep_as": "../x"}, "'keep_as' must be a name")]:
        with pytest.raises(InvalidArgumentError, match=message):
            RunRequest.from_meta(meta)
    request = RunRequest("Model.step", [1], keep_as="per_worker_1")
    assert RunRequest.from_meta(request.to_meta()) == request
    assert RunReply.from_meta(RunReply(error="Traceback ...", error_type="ValueError").to_meta()).error_type == \
        "ValueError"
    trained = Trained(steps=50, global_step=1234, loss=0.25, batch_size=5000)
    assert RunReply.from_meta(RunReply(result=[1], trained=trained).to_meta()) == RunReply(result=[1], trained=trained)
    assert RunReply.from_meta(RunReply(error="x", trained=trained).to_meta()).trained == trained
    assert RunReply.from_meta({"result": 1}).trained == Trained()
    assert Trained.from_meta(Trained(1, 2, float("nan"), 3).to_meta()).loss is None  # NaN is no JSON
    for trained_meta, message in [([], "'trained' must be an object"), ({"steps": -1}, "'steps' must be a non-neg"),
                                  ({"steps": 1, "global_step": 2, "batch_size": 3, "loss": "x"}, "'trained.loss'")]:
        with pytest.raises(InvalidArgumentError, match=message):
            RunReply.from_meta({"result": None, "trained": trained_meta})


def test_a_coordinator_job_is_local_and_on_cpus_for_now():
    script = str(REPO / "examples" / "mnist_coordinator.py")
    assert JobConfig(script=script, coordinator=True).validate().coordinator
    assert JobConfig(script=script, coordinator=True, mode="sync").validate().mode == "sync"
    assert JobConfig(script=script, coordinator="outside").validate().coordinator == "outside"
    with pytest.raises(ConfigError, match="coordinator must be true, false or 'outside', got 'inside'"):
        JobConfig(script=script, coordinator="inside").validate()
    for fields in ({"backend": "ray"}, {"gpus_per_worker": 1}):
        with pytest.raises(ConfigError, match="in-graph replication runs on the local backend, on CPUs"):
            JobConfig(script=script, coordinator=True, **fields).validate()


def test_a_synchronous_coordinator_job_aggregates_the_workers_gradients_only():
    from types import SimpleNamespace

    from tensorfleet.launch.task import _aggregate_workers_only
    from tensorfleet.protocol.specs import SyncOptions

    def replica(asked: int | None) -> SimpleNamespace:  # a chief and 2 workers: 3 replicas
        options = SyncOptions(replicas_to_aggregate=asked)
        return SimpleNamespace(sync=options.resolve(3), options=SimpleNamespace(sync=options))
    default = replica(None)
    _aggregate_workers_only(default, 2)
    assert (default.sync.replicas_to_aggregate, default.sync.total_num_replicas) == (2, 3)  # the coordinator: none
    backups = replica(1)
    _aggregate_workers_only(backups, 2)
    assert backups.sync.replicas_to_aggregate == 1
    with pytest.raises(ConfigError, match="replicas_to_aggregate=3 but the job has 2 worker"):
        _aggregate_workers_only(replica(3), 2)
    asynchronous = SimpleNamespace(sync=None, options=SimpleNamespace(sync=None))
    _aggregate_workers_only(asynchronous, 2)
    assert asynchronous.sync is None


def test_a_coordinator_from_outside_is_in_the_cluster_but_not_started_and_not_waited_for(capsys):
    from tensorfleet.cli import main

    assert main(["launch", "--coordinator-outside", "--ps", "1", "--workers", "2", "--dry-run",
                 str(REPO / "examples" / "mnist_coordinator.py")]) == 0
    shown = capsys.readouterr().out
    assert "chief:0 (chief) at 127.0.0.1:" in shown and "worker:1 (worker)" in shown
    assert "not started: the coordinator, a Python session that joins with tfl.join_fleet(LOGDIR)" in shown
    assert shown.count("TF_CONFIG=") == 3  # the ps and the two workers

    from tensorfleet.backends.local import local_launcher
    launcher = local_launcher(JobConfig(script=str(REPO / "examples" / "mnist_coordinator.py"), workers=2,
                                       coordinator="outside").validate())
    assert [r.name for r in launcher.supervisor.workers] == ["worker:0", "worker:1"]  # the job ends without it
