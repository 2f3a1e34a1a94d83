"""A restore is one cut of the fleet in every case (issue 42), driven in one process: two scalars on two ps, SGD
lr 1, every push a gradient of 1 for both, so a push on one shard only shows as a != b.

Before: a save failed by a killed ps left the other shard fenced, holding a worker's push (5 s); the worker gave
the push up (its part on the dead ps failed), and the forced restore let the held part through onto the restored
shard alone (a = -1, b = 0). A chief restarted together with a ps restored the empty ps only. Now a failed save
releases what it fenced, a push names the epoch it was computed on (a restored shard refuses older ones, on
every shard alike), and a chief finding some shards live and others empty restores all of them, fenced."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import NotInitializedError, TensorfleetError, UnavailableError
from tensorfleet.protocol.messages import FenceRequest
from tensorfleet.protocol.specs import OptimizerSpec
from tensorfleet.ps.server import Server
from tensorfleet.testing.fleet import poll
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.train.checkpoint import Checkpointer
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.worker.client import PsClient
from tensorfleet.worker.replica import Replica

pytestmark = pytest.mark.cluster
PLACEMENT = {"a": 0, "b": 1}  # one scalar on each ps
SGD = OptimizerSpec.sgd(lr=1.0)
ONES = {"a": torch.ones(1), "b": torch.ones(1)}


def client(cluster) -> PsClient:
    made = PsClient(cluster, PLACEMENT)
    made.wait_for_shards(10)  # learns each shard's data port
    return made


def the_store(server: Server):
    return server.service.store


def held(server: Server) -> int:
    store = the_store(server)
    with store._cond:
        return len(store._fence.held) if store._fence is not None else 0


def values(servers: list[Server]) -> tuple[float, float]:
    return float(the_store(servers[0]).read()[0]["a"]), float(the_store(servers[1]).read()[0]["b"])


def restart_empty(cluster, servers: list[Server], index: int) -> None:
    """ps ``index`` killed (nothing of it answers) and started again on its address, empty."""
    servers[index] = Server(cluster, job_name="ps", task_index=index)


def test_a_save_failed_by_a_killed_ps_releases_the_shard_it_fenced_and_the_restore_is_a_cut():
    with ps_servers(num_ps=2) as (cluster, servers):
        chief, worker = client(cluster), client(cluster)
        chief.initialize({"a": torch.zeros(1), "b": torch.zeros(1)}, SGD)
        checkpoint = chief.snapshot()  # a == b == 0
        worker.pull()
        worker.push(ONES)
        servers[1].stop(grace_s=0)  # ps:1 killed
        with pytest.raises(TensorfleetError):
            chief.start_snapshot()  # the save: ps:0 fenced, ps:1's Fence fails
        assert the_store(servers[0])._fence is None  # released at once, not held for 5 s
        with pytest.raises(UnavailableError):
            worker.push(ONES)  # its part on ps:0 applies (old timeline), the one on ps:1 fails
        restart_empty(cluster, servers, 1)
        chief.wait_for_shards(10)
        chief.initialize({}, SGD, restore=checkpoint, force=True)  # as the chief's recovery does
        worker.wait_for_shards(10)
        assert worker.settle_abandoned(10) == 0
        assert values(servers) == (0.0, 0.0)
        worker.pull()
        worker.push(ONES)
        assert values(servers) == (-1.0, -1.0)
        chief.close()
        worker.close()


def test_a_push_held_across_a_forced_restore_is_refused_on_every_shard():
    """The chief died mid-save: its fence on ps:0 stays (30 s here). ps:1 is killed; a worker's push waits on ps:0
    and fails on ps:1; ps:1 restarts empty and a new chief restores both, fenced. The held part names the epoch
    it was computed on, which the restore ended: refused, not applied on ps:0 alone."""
    with ps_servers(num_ps=2) as (cluster, servers):
        chief, worker = client(cluster), client(cluster)
        chief.initialize({"a": torch.zeros(1), "b": torch.zeros(1)}, SGD)
        checkpoint = chief.snapshot()
        worker.pull()
        fence = DataChannel(task="/job:ps/task:0")
        fence.set_address(*chief.data[0].address)
        fence.call("Fence", FenceRequest(hold_s=30).to_meta())  # a save begun, its chief gone
        fence.close()
        servers[1].stop(grace_s=0)
        pushed = worker.push_async(ONES)
        poll(lambda: held(servers[0]) == 1, 10, "the push's part to be held on ps:0")
        with pytest.raises(UnavailableError):
            pushed.result()  # its part on ps:1 failed: given up while the part on ps:0 is held
        restart_empty(cluster, servers, 1)
        chief.wait_for_shards(10)
        chief.initialize({}, SGD, restore=checkpoint, force=True)
        poll(lambda: held(servers[0]) == 0, 10, "the held part to be let go")
        assert values(servers) == (0.0, 0.0)  # before: (-1, 0), the held part applied on the restored ps:0
        assert worker.settle_abandoned(10) == 0
        worker.wait_for_shards(10)  # ps:1's new data port, as the worker's recovery learns it
        with pytest.raises(NotInitializedError, match="restored since"):
            worker.push(ONES)  # computed on the old timeline: refused, the worker pulls again
        assert values(servers) == (0.0, 0.0)
        worker.pull()
        worker.push(ONES)
        assert values(servers) == (-1.0, -1.0)
        chief.close()
        worker.close()


class TwoScalars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(()))  # round robin: ps 0
        self.b = nn.Parameter(torch.zeros(()))  # ps 1


def chief_replica(cluster) -> Replica:
    model = TwoScalars()
    return Replica(model, cluster, TaskSpec("worker", 0), optimizer=SGD, init_timeout_s=30)


def train(replica: Replica, steps: int) -> None:
    for _ in range(steps):
        replica.pull()
        (replica.module.a + replica.module.b).backward()
        replica.push()


def test_a_chief_restarted_with_a_ps_restores_every_shard_from_the_checkpoint(tmp_path, caplog):
    with ps_servers(num_ps=2) as (cluster, servers):
        first = Checkpointer(tmp_path).start(chief_replica(cluster))
        train(first, 5)
        Checkpointer(tmp_path).save(first)  # model.ckpt-5: a == b == -5
        train(first, 3)
        first.finish(done=False)  # the chief killed ...
        servers[1].stop(grace_s=0)  # ... and ps:1 with it
        restart_empty(cluster, servers, 1)
        with caplog.at_level(logging.WARNING, logger="tensorfleet.worker.replica"):
            second = Checkpointer(tmp_path).start(chief_replica(cluster))
        assert values(servers) == (-5.0, -5.0)  # before: (-8, -5), the live ps:0 kept, the empty ps:1 restored
        assert second.global_step == 5
        assert "every shard restored to global step 5" in caplog.text
        assert "ps task(s) [1] are empty while ps task(s) [0] hold trained variables" in caplog.text
        train(second, 2)
        assert values(servers) == (-7.0, -7.0)
        second.finish(done=False)


def test_a_chief_restarted_with_a_ps_and_no_checkpoint_restores_the_live_state_everywhere():
    with ps_servers(num_ps=2) as (cluster, servers):
        first = chief_replica(cluster).start()
        train(first, 3)
        first.finish(done=False)
        servers[1].stop(grace_s=0)
        restart_empty(cluster, servers, 1)
        second = chief_replica(cluster).start()  # every shard forced: ps:0 its own state, ps:1 initial values
        assert values(servers) == (-3.0, 0.0) and second.global_step == 3
        assert the_store(servers[0]).status().initial_updates == 3  # restored (fenced), not left live
        second.finish(done=False)
