"""Delta checkpoints of evicting tables on real ps servers: a chain loads to exactly what a full save holds,
restores into another number of ps, is small, and starts over whole when the fleet's timeline changed."""

from __future__ import annotations

import time

import pytest
import torch

from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import DataError, InvalidArgumentError, NotInitializedError, UnavailableError
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.train.checkpoint import Checkpointer, chain, gather, load, load_file, split
from tensorfleet.train.manifest import read_manifest
from tensorfleet.worker.embedding import EmbeddingTable
from tensorfleet.wire.datachannel import DataChannel
from tensorfleet.worker.snapshots import SnapshotInFlight
from tensorfleet.worker.replica import Replica

pytestmark = pytest.mark.cluster
DIM = 4


def model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "t": EmbeddingTable("t", DIM, optimizer=OptimizerSpec("adagrad", {"lr": 0.1}),
                            initializer=RowInitializer.normal(0.1, seed=3), max_rows=300),
        "head": torch.nn.Linear(DIM, 1)})


def train(replica: Replica, net: torch.nn.ModuleDict, steps: range, new: int = 40) -> None:
    for step in steps:
        ids = torch.cat([torch.arange(8), 10_000 + torch.arange(step * new, step * new + new)])  # 8 hot, the rest new
        net["head"](net["t"](ids)).pow(2).mean().backward()
        replica.push()


def rows(state) -> dict[int, list[float]]:
    table = state.tables["t"]
    return {i: table.values[k].tolist() + table.slots["sum"][k].tolist()
            for k, i in enumerate(table.ids.tolist())}


def test_a_chain_of_deltas_loads_to_what_a_full_save_holds_and_restores_into_other_ps(tmp_path):
    saver = Checkpointer(tmp_path / "ckpt", full_every=4, max_to_keep=2)
    with ps_servers(num_ps=2) as (cluster, servers):
        net = model()
        with Replica(net, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            paths = []
            for block in range(6):
                train(replica, net, range(block * 10, block * 10 + 10), new=40 if block < 5 else 0)
                paths.append(saver.save(replica))
                truth = gather(replica.placement, replica.client.snapshot())
                restored = load(paths[-1]).state
                assert rows(restored) == rows(truth)  # evicted rows gone, changed rows current
                needed = {p.name for kept in paths[-2:] for p in chain(kept)}
                assert set(read_manifest(tmp_path / "ckpt")["all"]) == needed  # a kept delta keeps its chain
                assert restored.global_step == truth.global_step
                assert torch.equal(restored.values["head.weight"], truth.values["head.weight"])
            evicted = sum(server.status()["tables"]["t"]["evicted"] for server in servers)
            assert evicted > 0
    names = [p.name for p in paths]
    assert [".delta." in n for n in names] == [False, True, True, True, False, True]
    full, delta = paths[4].stat().st_size, paths[5].stat().st_size
    assert delta < 0.1 * full  # the last block touched only the 8 hot rows of ~600
    assert [p.name for p in chain(paths[5])] == names[4:]
    kept = read_manifest(tmp_path / "ckpt")["all"]
    assert kept == names[4:]  # the last 2: the newest full checkpoint and its delta; the older chain is gone
    with pytest.raises(DataError, match="does not exist"):
        load(tmp_path / "ckpt" / names[2])  # deleted with its chain's full file

    with ps_servers(num_ps=3) as (cluster, servers):
        net = model()
        with Checkpointer(tmp_path / "ckpt").start(
                Replica(net, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1))) as replica:
            assert rows(gather(replica.placement, replica.client.snapshot())) == rows(load(paths[-1]).state)


def test_a_restored_fleet_saves_whole_before_it_saves_deltas_again(tmp_path):
    saver = Checkpointer(tmp_path / "ckpt", full_every=10)
    with ps_servers(num_ps=2) as (cluster, servers):
        net = model()
        with Replica(net, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            train(replica, net, range(0, 5))
            first = saver.save(replica)
            train(replica, net, range(5, 10))
            second = saver.save(replica)
            assert ".delta." in second.name
            parts = split(load(first).state, replica.placement, 2, sync=False)
            for server, part in zip(servers, parts):  # every shard rolled back (as after a lost ps): a new timeline
                server.store.initialize(part.values, OptimizerSpec.sgd(lr=0.1), restore=part, force=True,
                                        tables=list(replica.client.tables.values()))
            with pytest.raises(NotInitializedError, match="restored since"):
                train(replica, net, range(10, 11))  # computed on the old timeline: refused (issue 42)
            replica.recover(restore=None, timeout_s=30)  # as a step's recovery does: the restored values pulled
            train(replica, net, range(10, 12))
            third = saver.save(replica)
            assert ".delta." not in third.name
            info = load(third).info
            assert info["chain_length"] == 0 and len(info["epochs"]) == 2


def test_ckpt_ls_shows_the_chain_and_compact_sums_it_into_one_full_checkpoint(tmp_path):
    from tensorfleet.launch import ckpt

    directory = tmp_path / "ckpt"
    saver = Checkpointer(directory, full_every=5)
    with ps_servers(num_ps=2) as (cluster, servers):
        net = model()
        with Replica(net, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            paths = []
            for block in range(3):
                train(replica, net, range(block * 10, block * 10 + 10))
                paths.append(saver.save(replica))
    listed = ckpt.list_text(directory).splitlines()
    assert listed[1].endswith("full") and listed[2].endswith(f"delta on {paths[0].name}")
    assert listed[3].endswith(f"delta on {paths[1].name}  (latest)")
    full, delta = ckpt.show_text(paths[0]), ckpt.show_text(paths[2])  # the tables: rows, width, slots, rules
    held, changed = load(paths[0]).state.tables["t"], load_file(paths[2]).state
    assert f"t{'':<27}{held.ids.numel():>12,}  4    float32   last_update, sum" in full, full
    assert "  optimizer adagrad {'lr': 0.1}, max_rows 300" in full
    assert (f"{changed.tables['t'].ids.numel():>12,}  4    float32   last_update, sum; "
            f"{changed.evicted['t'].numel()} evicted") in delta, delta
    summed = rows(load(paths[-1]).state)
    said = ckpt.compact(directory)
    assert said.startswith("wrote model.ckpt-30.safetensors") and "the sum of 3 files" in said
    assert read_manifest(directory)["all"] == ["model.ckpt-30.safetensors"]
    assert not any(p.exists() for p in paths)
    compacted = load(directory)
    assert compacted.path.name == "model.ckpt-30.safetensors" and rows(compacted.state) == summed
    assert ckpt.compact(directory).endswith("is a full checkpoint already: nothing to compact")


def test_a_background_checkpoint_is_written_after_save_returns_and_its_error_is_not_lost(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    saver = Checkpointer(directory, full_every=3, background=True)
    with ps_servers(num_ps=2) as (cluster, servers):
        net = model()
        with Replica(net, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            train(replica, net, range(0, 5))
            first = saver.save(replica)
            train(replica, net, range(5, 10))
            second = saver.save(replica)  # waits for the first: it is the base of this delta
            assert first.exists() and ".delta." in second.name
            saver.wait()
            assert rows(load(second).state) == rows(gather(replica.placement, replica.client.snapshot()))

            import errno

            import tensorfleet.train.checkpoint as checkpoint_module

            def full_disk(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(checkpoint_module, "save", full_disk)
            train(replica, net, range(10, 12))
            saver.save(replica)  # returns: the writing fails in the background
            with pytest.raises(OSError, match="No space left on device"):
                saver.wait()
            saver.wait()  # said once
            monkeypatch.undo()
            assert load(directory).path == second  # the manifest still names the last file written

            def ps_gone(self):
                raise UnavailableError("the data connection broke")

            monkeypatch.setattr(SnapshotInFlight, "result", ps_gone)
            train(replica, net, range(12, 14))
            saver.save(replica)
            saver.wait()  # a ps that went away while its rows were read: logged, not raised; training goes on
            monkeypatch.undo()
            train(replica, net, range(14, 16))
            third = saver.save(replica)
            saver.wait()
            assert load(directory).path == third and ".delta." in third.name


def test_a_shard_too_big_for_one_message_is_read_in_pages_that_add_up_to_it(tmp_path, monkeypatch):
    import tensorfleet.ps.store as store_module

    saver = Checkpointer(tmp_path / "ckpt", full_every=3)
    with ps_servers(num_ps=2) as (cluster, servers):
        net = model()
        with Replica(net, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            train(replica, net, range(0, 10))
            whole = rows(gather(replica.placement, replica.client.snapshot()))
            monkeypatch.setattr(store_module, "SNAPSHOT_PAGE_BYTES", 2_000)  # ~40 rows a page
            assert servers[0].store.snapshot().pages > 5
            assert rows(gather(replica.placement, replica.client.snapshot())) == whole
            full = saver.save(replica)
            train(replica, net, range(10, 20))
            delta = saver.save(replica)
            assert ".delta." in delta.name and servers[0].store.snapshot(since=0).pages > 1
            truth = gather(replica.placement, replica.client.snapshot())
            assert rows(load(delta).state) == rows(truth) and rows(load(full).state) == whole
            assert torch.equal(load(delta).state.values["head.weight"], truth.values["head.weight"])


def test_while_one_shard_sends_its_pages_no_other_shard_body_waits_unread(monkeypatch):
    """A ps gives up on a reply it cannot send for ``deadline_s``: a shard's snapshot must not sit unread while
    another shard's pages are asked for one by one (here the dense shard's 32 MB page outlasts its socket
    buffers while the other shard's rows come in slow pages)."""
    import tensorfleet.ps.store as store_module
    from tensorfleet.cluster.idhash import shard_of
    from tensorfleet.ps.store import VariableStore
    from tensorfleet.wire.rpc import WireOptions

    taken_whole = VariableStore.snapshot

    def slow_pages(store, since=None, page=0, pages=None, cut=None, token=""):
        if page > 0:
            time.sleep(0.4)  # later pages come slowly: well past the servers' send limit, all told
        return taken_whole(store, since, page, pages, cut=cut, token=token)

    with ps_servers(num_ps=2, options=WireOptions(deadline_s=1.5)) as (cluster, servers):
        torch.manual_seed(0)
        net = torch.nn.ModuleDict({"t": EmbeddingTable("t", DIM, optimizer=OptimizerSpec.sgd(lr=0.1)),
                                   "big": torch.nn.Linear(2048, 4096)})
        with Replica(net, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            dense = next(part.shard for part in replica.placement.parts if part.name == "big.weight")
            paged = 1 - dense
            candidates = torch.arange(2000)
            ids = candidates[torch.from_numpy(shard_of(candidates, 2) == paged)][:400]  # rows on the other ps only
            net["t"](ids).sum().backward()
            replica.push()
            monkeypatch.setattr(store_module, "SNAPSHOT_PAGE_BYTES", 2_000)  # ~10 pages of rows; the dense ps: one
            monkeypatch.setattr(VariableStore, "snapshot", slow_pages)
            assert servers[paged].store.snapshot().pages > 5 and servers[dense].store.snapshot().pages == 1
            shards = replica.client.start_snapshot().result()
            assert shards[paged].tables["t"].ids.numel() == 400 and shards[dense].tables["t"].ids.numel() == 0
            held = sum(value.numel() for shard in shards.values() for value in shard.values.values())
            assert held == sum(p.numel() for p in net["big"].parameters())


def test_a_snapshot_on_the_data_plane_is_the_grpc_one_and_a_bad_one_changes_nothing():
    """The chief fetches snapshots over the data plane (tens of MB cross gRPC slowly); the reply is the same
    state the gRPC method gives, and a Snapshot request carrying tensors is refused with the ps serving on."""
    with ps_servers(num_ps=2) as (cluster, servers):
        net = model()
        with Replica(net, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            train(replica, net, range(5))
            since = servers[1].store.snapshot().applied_updates - 2
            for ask in ({}, {"since": since}):
                data = replica.client.snapshot(since=[ask.get("since"), ask.get("since")])
                for shard, state in enumerate(data):
                    meta, tensors = replica.client.channels[shard].call("Snapshot", ask)
                    assert state.since == meta["since"] and state.global_step == meta["global_step"]
                    assert set(state.flatten()) == set(tensors)
                    assert all(torch.equal(state.flatten()[k], tensors[k]) for k in tensors)
            channel = DataChannel(task="/job:ps/task:0")
            channel.set_address(*replica.client.data[0].address)
            try:
                with pytest.raises(InvalidArgumentError, match="carries no tensors"):
                    channel.call("Snapshot", {}, {"x": torch.zeros(3)})
                with pytest.raises(InvalidArgumentError, match="'since' must be an update number"):
                    channel.call("Snapshot", {"since": -1})
                with pytest.raises(InvalidArgumentError, match="'since' must be an update number"):
                    channel.call_in_two("Snapshot", {"since": -1})  # refused at the head: the channel is free again
                meta, body = channel.call_in_two("Snapshot", {})
                assert meta["since"] is None and "table/t/ids" in body()
            finally:
                channel.close()
            assert replica.client.snapshot(shards=[]) == {}  # every ps restarted empty, nothing to keep
            before = rows(gather(replica.placement, replica.client.snapshot()))
            train(replica, net, range(5, 6))  # still serving, and the state moved only by the push
            assert rows(gather(replica.placement, replica.client.snapshot())) != before


def test_a_snapshot_is_the_state_when_every_shard_took_it_though_its_rows_are_read_after_more_training():
    """The chief waits only until each shard has taken its state (``start_snapshot``); the rows read later are
    that state, not what later pushes made of it: a background checkpoint is the fleet at its step."""
    with ps_servers(num_ps=2) as (cluster, servers):
        net = model()
        with Replica(net, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=0.1)) as replica:
            train(replica, net, range(3))
            before = gather(replica.placement, replica.client.snapshot())
            taken = replica.client.start_snapshot()
            assert taken.heads[0].global_step == before.global_step  # ps 0 counts the step (async)
            train(replica, net, range(3, 6))  # pushes applied while the rows are still to be read
            after = gather(replica.placement, replica.client.snapshot())
            got = taken.result()
            read = gather(replica.placement, [got[0], got[1]])
            assert rows(read) == rows(before) != rows(after) and read.global_step == before.global_step
            assert torch.equal(read.values["head.weight"], before.values["head.weight"])
            dropped = replica.client.start_snapshot()
            dropped.discard()  # not read: its connections are closed, the ps goes on serving
            assert rows(gather(replica.placement, replica.client.snapshot())) == rows(after)
