"""A model on a device trains through ``Replica`` exactly as the same model does in one local process (issue 39).

Every test runs on two devices:

* ``staged-cpu``: the model in host memory with ``TENSORFLEET_HOST_STAGING=always``: every value and gradient
  goes through the host buffers and copies a GPU model's take (worker/staging.py), so CI, which has no GPU,
  proves that path: a pull that skipped the copy to the parameters, or a push that skipped the gradients'
  copy to the host, would train something else than the local loop and fail here;
* ``cuda``: the model on the GPU, where CUDA exists (skipped elsewhere, saying so).

The reference is plain PyTorch on the same device (torch.optim.SGD, same batches, an ``nn.EmbeddingBag`` whose
rows start where the ps's do); prefetch (values one update older by design) is compared with the same job of a
host model through ``Replica`` without staging.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorfleet.cluster.placement import RowPartitioner
from tensorfleet.cluster.spec import TaskSpec
from tensorfleet.protocol.specs import OptimizerSpec, RowInitializer
from tensorfleet.testing.local_cluster import ps_servers
from tensorfleet.train.checkpoint import load_into_module
from tensorfleet.train.session import TrainingSession
from tensorfleet.train.hooks import StopAtStepHook
from tensorfleet.worker.embedding import EmbeddingTable
from tensorfleet.worker.replica import Replica
from tensorfleet.worker.staging import FORCE_ENV

LR = 0.1
STEPS = 5
ROWS, DIM = 50, 4
CUDA = torch.cuda.is_available()

DEVICES = [pytest.param("staged-cpu", id="staged-cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
               not CUDA, reason="no CUDA device here: the staged-cpu variant proves the staging path on the CPU"))]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch) -> torch.device:
    """The device the model trains on; on ``staged-cpu`` host parameters are staged like a GPU's."""
    if request.param == "staged-cpu":
        monkeypatch.setenv(FORCE_ENV, "always")
        return torch.device("cpu")
    monkeypatch.delenv(FORCE_ENV, raising=False)
    return torch.device("cuda")


class Net(nn.Module):
    """A small MLP, with an embedding table on the ps (``fleet``) or a local one (the reference)."""

    def __init__(self, *, table: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6 + (DIM if table else 0), 8), nn.Tanh(), nn.Linear(8, 3))
        self.table: nn.Module | None = None
        if table == "fleet":
            self.table = EmbeddingTable("ids", DIM, num_rows=ROWS, pooling="sum",
                                        optimizer=OptimizerSpec("sgd", {"lr": LR}))
        elif table == "local":
            self.table = nn.EmbeddingBag(ROWS, DIM, mode="sum")
            with torch.no_grad():  # where the ps's rows start
                self.table.weight.copy_(RowInitializer().rows(torch.arange(ROWS), DIM))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            x = torch.cat([x, self.table(ids)], 1)
        return self.body(x)


def batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=generator).to(device),
             torch.randint(0, ROWS, (8, 3), generator=generator).to(device),
             torch.randint(0, 3, (8,), generator=generator).to(device)) for _ in range(STEPS)]


@dataclasses.dataclass
class Trained:
    losses: list[float]
    values: dict[str, torch.Tensor]  # dense parameters, in host memory
    rows: torch.Tensor | None  # the table's rows 0..ROWS-1


def train_locally(device: torch.device, *, table: bool) -> Trained:
    model = Net(table="local" if table else None).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, ids, y in batches(device):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x, ids), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    values = {name: p.detach().cpu() for name, p in model.named_parameters() if not name.startswith("table.")}
    return Trained(losses, values, model.table.weight.detach().cpu() if table else None)


def train_on_fleet(device: torch.device, *, num_ps: int, table: bool, staged: bool, **options) -> Trained:
    with ps_servers(num_ps=num_ps, num_workers=1) as (cluster, _):
        model = Net(table="fleet" if table else None).to(device)
        losses = []
        with Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=LR),
                     **options) as replica:
            assert replica._staging.active is staged
            for name, part in replica._param_views.items():  # staged: values land beside the parameters
                assert (part.data_ptr() != replica._device_views[name].data_ptr()) is staged, name
            for x, ids, y in batches(device):
                replica.pull()
                loss = F.cross_entropy(model(x, ids), y)
                loss.backward()
                replica.push()
                losses.append(loss.item())
            replica.settle()
            replica.pull()
            values = {name: p.detach().cpu() for name, p in model.named_parameters()}
            rows = replica.client.lookup({"ids": torch.arange(ROWS)})["ids"] if table else None
    return Trained(losses, values, rows)


def assert_same(got: Trained, want: Trained, *, exact: bool) -> None:
    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-4, atol=1e-5)

    assert close(torch.tensor(got.losses), torch.tensor(want.losses)), (got.losses, want.losses)
    assert got.values.keys() == want.values.keys()
    for name, value in want.values.items():
        assert close(got.values[name], value), name
    if want.rows is not None:
        assert close(got.rows, want.rows)


@pytest.mark.parametrize("num_ps, table, options", [
    (1, False, {}),
    (2, True, {}),
    (2, True, {"overlap": True}),
    (2, True, {"mode": "sync"}),
    (2, False, {"overlap": True, "partitioner": RowPartitioner(num_parts=2)}),
], ids=["1ps", "2ps-table", "2ps-table-overlap", "2ps-table-sync", "2ps-partitioned-overlap"])
def test_a_device_model_trains_as_the_local_loop_on_its_device(device, num_ps, table, options):
    got = train_on_fleet(device, num_ps=num_ps, table=table, staged=True, **options)
    assert_same(got, train_locally(device, table=table), exact=False)


@pytest.mark.parametrize("options", [{"prefetch": True}, {"prefetch": True, "overlap": True},
                                     {"wire_dtype": torch.bfloat16}],
                         ids=["prefetch", "prefetch-overlap", "bf16-wire"])
def test_a_device_model_trains_as_a_host_model_through_the_replica(device, monkeypatch, options):
    """Prefetch computes on values one update older, bf16 on the wire rounds them: not the local loop's, but
    exactly (on the CPU) the unstaged host model's."""
    got = train_on_fleet(device, num_ps=2, table=True, staged=True, **options)
    monkeypatch.delenv(FORCE_ENV, raising=False)
    want = train_on_fleet(torch.device("cpu"), num_ps=2, table=True, staged=False, **options)
    assert_same(got, want, exact=device.type == "cpu")


def test_a_device_model_checkpoints_and_loads_back_onto_its_device(device, tmp_path):
    """TrainingSession with a checkpoint hook over a device model; the checkpoint loads into a model on the
    device, outside any cluster, with the values the fleet trained."""
    with ps_servers(num_ps=2, num_workers=1) as (cluster, _):
        model = Net(table="fleet").to(device)
        replica = Replica(model, cluster, TaskSpec("worker", 0), optimizer=OptimizerSpec.sgd(lr=LR))
        data = iter(batches(device))
        with TrainingSession(replica, hooks=[StopAtStepHook(last_step=STEPS)], checkpoint_dir=tmp_path,
                             save_checkpoint_steps=STEPS, summary_dir=False) as session:
            while not session.should_stop():
                x, ids, y = next(data)
                session.run_step(lambda: F.cross_entropy(model(x, ids), y), batch_size=8)
            trained = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
            x, ids, _ = batches(device)[0]
            with torch.no_grad():
                fleet_out = model(x, ids).cpu()
    served = Net(table="fleet").to(device)
    assert load_into_module(served, tmp_path) == STEPS
    for name, p in served.named_parameters():
        assert p.device.type == device.type and torch.equal(p.detach().cpu(), trained[name]), name
    with torch.no_grad():
        assert torch.allclose(served(x, ids).cpu(), fleet_out, rtol=1e-5, atol=1e-6)
