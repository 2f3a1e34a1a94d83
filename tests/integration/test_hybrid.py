"""Hybrid mode (issue 40): dense parameters replicated on the workers and averaged by gloo, tables on the ps.

Two workers run as two threads of this process (each with its own Replica, ps connections and gloo group),
the ps in-process: fast, and the collective is torch's real gloo over 127.0.0.1, met through ps 0's Rendezvous.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.worker.embedding import EmbeddingTable
from tensorfleet.train.checkpoint import Checkpointer, latest_checkpoint, load, load_into_module
from tensorfleet.train.hooks import StopAtStepHook
from tensorfleet.train.session import TrainingSession
from tensorfleet.worker import dense as dense_module
from tensorfleet.worker.client import PsClient
from tensorfleet.worker.replica import Replica

LR, STEPS, BATCH, ROWS, DIM = 0.1, 4, 8, 40, 4


class Net(nn.Module):
    def __init__(self, *, table: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6 + DIM, 16), nn.Tanh(), nn.Linear(16, 3))
        if table == "fleet":
            self.table: nn.Module = EmbeddingTable("ids", DIM, num_rows=ROWS, pooling="sum",
                                                   optimizer=OptimizerSpec("sgd", {"lr": LR}))
        else:
            self.table = nn.EmbeddingBag(ROWS, DIM, mode="sum")
            with torch.no_grad():
                self.table.weight.copy_(RowInitializer().rows(torch.arange(ROWS), DIM))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.body(torch.cat([x, self.table(ids)], 1))


def batches(worker: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + worker)
    return [(torch.randn(BATCH, 6, generator=generator), torch.randint(0, ROWS, (BATCH, 3), generator=generator),
             torch.randint(0, 3, (BATCH,), generator=generator)) for _ in range(STEPS)]


def train_workers(num_workers: int, *, mode: str, num_ps: int = 2, **options) -> tuple[list[dict], torch.Tensor, int]:
    """Each worker's dense values after training, the table's rows, the global step."""
    with ps_servers(num_ps=num_ps, num_workers=num_workers) as (cluster, _):
        models = [Net(table="fleet") for _ in range(num_workers)]  # here: torch's seed is global to the threads

        def worker(index: int) -> dict:
            model = models[index]
            with Replica(model, cluster, TaskSpec("worker", index), optimizer=OptimizerSpec.sgd(lr=LR),
                         mode=mode, dense="allreduce", init_timeout_s=60, **options) as replica:
                assert not replica.placement.parts, "hybrid: no dense variable on the ps"
                for x, ids, y in batches(index):
                    replica.pull()
                    F.cross_entropy(model(x, ids), y).backward()
                    replica.push()
                return {name: p.detach().clone() for name, p in model.body.named_parameters()}

        results = run_threads(worker, num_workers)
        client = PsClient(cluster, {}, tables=[Net(table="fleet").table.spec()])  # the replicas have finished
        try:
            client.wait_for_shards(10)
            rows = client.lookup({"ids": torch.arange(ROWS)})["ids"]
            step = client.global_step()
        finally:
            client.close()
        return results, rows, step


def train_locally(num_workers: int, *, skip_dense_at: int | None = None) -> tuple[dict, torch.Tensor]:
    """One process, each step on the union of the workers' batches (at ``skip_dense_at`` the table's rows only)."""
    model = Net(table="local")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    per_worker = [batches(i) for i in range(num_workers)]
    for step in range(STEPS):
        x, ids, y = (torch.cat(parts) for parts in zip(*(per_worker[i][step] for i in range(num_workers))))
        optimizer.zero_grad()
        F.cross_entropy(model(x, ids), y).backward()
        if step == skip_dense_at:
            model.body.zero_grad(set_to_none=True)  # plain SGD: a parameter without a gradient stays as it is
        optimizer.step()
    return {name: p.detach() for name, p in model.body.named_parameters()}, model.table.weight.detach()


@pytest.mark.parametrize("bucket_bytes", [None, 64], ids=["one-bucket", "a-bucket-per-tensor"])
def test_two_sync_workers_end_where_one_process_on_the_union_batch_ends(monkeypatch, bucket_bytes):
    """Dense and table rows alike; with small buckets, each leaves during backward as soon as it is full."""
    if bucket_bytes:
        monkeypatch.setattr(dense_module, "BUCKET_BYTES", bucket_bytes)
        monkeypatch.setattr(dense_module, "FIRST_BUCKET_BYTES", bucket_bytes)
    got, rows, step = train_workers(2, mode="sync")
    want, want_rows = train_locally(2)
    assert step == STEPS
    for values in got:
        for name, value in want.items():
            assert torch.allclose(values[name], value, rtol=1e-5, atol=1e-6), name
    assert torch.allclose(rows, want_rows, rtol=1e-5, atol=1e-6)


def test_one_worker_trains_as_the_local_loop_with_overlap_and_prefetch_of_rows():
    got, rows, step = train_workers(1, mode="async", num_ps=1, overlap=True)
    want, want_rows = train_locally(1)
    assert step == STEPS
    for name, value in want.items():
        assert torch.allclose(got[0][name], value, rtol=1e-5, atol=1e-6), name
    assert torch.allclose(rows, want_rows, rtol=1e-5, atol=1e-6)


def test_async_tables_with_sync_dense_keeps_every_replica_equal():
    """Persia's mode: each worker's rows applied on arrival, the dense all-reduce in lockstep: the workers'
    dense parameters stay equal to the bit, and every push counts a global step."""
    got, _, step = train_workers(2, mode="async")
    assert step == 2 * STEPS
    for name, value in got[0].items():
        assert torch.equal(got[1][name], value), name


@pytest.mark.parametrize("policy", ["reject", "apply"])
def test_nan_in_one_workers_dense_gradient_is_rejected_on_every_worker_and_training_goes_on(policy):
    """Worker 1's output bias gets a NaN gradient at step 1 (its rows stay finite). Under "reject" (the default)
    no worker applies that step's dense update, each counts it as a dropped gradient, the rows are applied, and
    the job ends where the local loop ends when it skips that one dense update; "apply" lets the NaN in."""
    poisoned_step = 1
    with ps_servers(num_ps=2, num_workers=2) as (cluster, _):
        models = [Net(table="fleet") for _ in range(2)]

        def worker(index: int) -> tuple[dict, int]:
            model = models[index]
            with Replica(model, cluster, TaskSpec("worker", index), optimizer=OptimizerSpec.sgd(lr=LR), mode="sync",
                         dense="allreduce", init_timeout_s=60, nonfinite_gradients=policy) as replica:
                for step, (x, ids, y) in enumerate(batches(index)):
                    replica.pull()
                    hook = (model.body[2].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
                            if index == 1 and step == poisoned_step else None)
                    F.cross_entropy(model(x, ids), y).backward()
                    if hook is not None:
                        hook.remove()
                    replica.push()
                return {name: p.detach().clone() for name, p in model.body.named_parameters()}, \
                    replica.dropped_gradients

        results = run_threads(worker, 2)
        client = PsClient(cluster, {}, tables=[Net(table="fleet").table.spec()])
        try:
            client.wait_for_shards(10)
            rows = client.lookup({"ids": torch.arange(ROWS)})["ids"]
        finally:
            client.close()
    if policy == "apply":
        assert all(not torch.isfinite(values["2.bias"]).all() for values, _ in results)
        assert [dropped for _, dropped in results] == [0, 0]
        return
    want, want_rows = train_locally(2, skip_dense_at=poisoned_step)
    assert [dropped for _, dropped in results] == [1, 1]
    for values, _ in results:
        for name, value in want.items():
            assert torch.isfinite(values[name]).all(), name
            assert torch.allclose(values[name], value, rtol=1e-5, atol=1e-6), name
    assert torch.allclose(rows, want_rows, rtol=1e-5, atol=1e-6)


def test_a_dense_mode_that_does_not_exist_is_refused():
    with ps_servers(num_ps=1, num_workers=1) as (cluster, _):
        with pytest.raises(InvalidArgumentError, match="dense='ring'.*'allreduce'"):
            Replica(Net(table="fleet"), cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=LR),
                    dense="ring")


def run_threads(target, count: int) -> list:
    """``target(index)`` on ``count`` threads; their results (an exception is raised here)."""
    results: list = [None] * count

    def run(index: int) -> None:
        try:
            results[index] = target(index)
        except BaseException as exc:  # noqa: BLE001 - raised by the test thread
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def session_job(cluster, directory, *, workers: int, dense: str, last_step: int, momentum: float = 0.9):
    """Every worker trains through a TrainingSession whose chief checkpoints into ``directory`` at the end;
    each worker's dense values and optimizer slots after training."""
    models = [Net(table="fleet") for _ in range(workers)]  # here: torch's seed is global to the threads

    def worker(index: int) -> tuple[dict, dict]:
        model = models[index]
        replica = Replica(model, cluster, TaskSpec("worker", index), init_timeout_s=60, mode="sync", dense=dense,
                          optimizer=OptimizerSpec.sgd(lr=LR, momentum=momentum))
        data = iter(batches(index) * 4)
        with TrainingSession(replica, hooks=[StopAtStepHook(last_step=last_step)], checkpoint_dir=directory,
                             save_checkpoint_steps=1000, summary_dir=False, log_step_count_steps=None) as session:
            while not session.should_stop():
                x, ids, y = next(data)
                session.run_step(lambda: F.cross_entropy(model(x, ids), y), batch_size=BATCH)
            values = {n: p.detach().clone() for n, p in model.body.named_parameters()}
            slots = ({} if replica.dense is None else
                     {n: s["momentum_buffer"].clone() for n, s in replica.dense_state()[1].items()})
        return values, slots
    return run_threads(worker, workers)


def test_a_checkpoint_holds_the_chiefs_dense_state_and_the_ps_tables(tmp_path):
    with ps_servers(num_ps=2, num_workers=2) as (cluster, _):
        (values, slots), _ = session_job(cluster, tmp_path, workers=2, dense="allreduce", last_step=STEPS)
    saved = load(latest_checkpoint(tmp_path))
    assert saved.global_step == STEPS and saved.info["dense_updates"] == STEPS
    for name, value in values.items():
        assert torch.equal(saved.state.values[f"body.{name}"], value), name
        assert torch.equal(saved.state.slots[f"body.{name}"]["momentum_buffer"], slots[f"body.{name}"]), name
    assert saved.state.tables["ids"].ids.numel() > 0  # the rows from the ps, in the same file
    served = Net(table="fleet")
    assert load_into_module(served, tmp_path) == STEPS  # serving reads it as any checkpoint
    assert all(torch.equal(p.detach(), values[n]) for n, p in served.body.named_parameters())


@pytest.mark.parametrize("saved_as, restored_as, workers, num_ps",
                         [("allreduce", "allreduce", 3, 1), ("ps", "allreduce", 2, 2), ("allreduce", "ps", 1, 3)],
                         ids=["hybrid->hybrid-3w-1ps", "classic->hybrid", "hybrid->classic-3ps"])
def test_a_checkpoint_restores_into_either_layout_on_any_number_of_workers_and_ps(tmp_path, saved_as, restored_as,
                                                                                  workers, num_ps):
    """Training resumes from the checkpoint's step with its dense values and momentum on every worker: one more
    step from there equals one more step of the job that saved it."""
    with ps_servers(num_ps=2, num_workers=2) as (cluster, _):
        session_job(cluster, tmp_path / "a", workers=2, dense=saved_as, last_step=STEPS)
    saved = load(latest_checkpoint(tmp_path / "a"))
    with ps_servers(num_ps=num_ps, num_workers=workers) as (cluster, _):
        results = session_job(cluster, tmp_path / "a", workers=workers, dense=restored_as, last_step=STEPS)
    for values, slots in results:  # resumed at STEPS: nothing trained, every worker holds the checkpoint's state
        for name, value in values.items():
            assert torch.equal(value, saved.state.values[f"body.{name}"]), name
        for name, buffer in slots.items():
            assert torch.equal(buffer, saved.state.slots[name]["momentum_buffer"]), name


def test_moving_averages_mean_the_same_in_either_layout_and_training_goes_on_from_the_live_values(tmp_path):
    """average_decay: the workers keep the dense averages by the ps's rule; load_averages() shows them, the next
    pull() brings the live values back (the ps cannot: it does not hold them), and a checkpoint keeps them."""
    seen = {}
    for dense in ("ps", "allreduce"):
        with ps_servers(num_ps=1, num_workers=1) as (cluster, _):
            model = Net(table="fleet")
            with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=LR), dense=dense,
                         average_decay=0.9) as replica:
                for x, ids, y in batches(0):
                    replica.pull()
                    F.cross_entropy(model(x, ids), y).backward()
                    replica.push()
                live = {n: p.detach().clone() for n, p in model.body.named_parameters()}
                Checkpointer(tmp_path / dense).save(replica)
                replica.load_averages()
                averaged = {n: p.detach().clone() for n, p in model.body.named_parameters()}
                replica.pull()
                back = {n: p.detach().clone() for n, p in model.body.named_parameters()}
        seen[dense] = live, averaged, back
    for name in seen["ps"][0]:
        (live, averaged, back), (h_live, h_averaged, h_back) = seen["ps"], seen["allreduce"]
        assert torch.allclose(h_live[name], live[name], rtol=1e-5, atol=1e-6), name
        assert torch.allclose(h_averaged[name], averaged[name], rtol=1e-5, atol=1e-6), name
        assert not torch.allclose(h_averaged[name], h_live[name]), name  # the averages are not the live values
        assert torch.equal(h_back[name], h_live[name]), name
        for dense in ("ps", "allreduce"):  # the checkpoint keeps the averages in either mode
            saved = load(latest_checkpoint(tmp_path / dense))
            assert torch.allclose(saved.state.averages[f"body.{name}"], h_averaged[name], rtol=1e-5, atol=1e-6)
