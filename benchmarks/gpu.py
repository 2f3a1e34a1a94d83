"""Workers on a GPU, ps on the CPU (issue 39): tensorfleet against plain PyTorch on the same device, in one run.

One worker (this process, the model on ``--device``) and 1, 2 or 4 ps (each a ``python -m
tensorfleet.ps`` process of its own, on the CPU, one intra-op thread, the GPU hidden from it)
against the same model trained by plain PyTorch on the same device, in the same run:

* ``mlp``: the seed MLP 784-100-10 (``examples/mnist_mlp.py`` ``build_model``), batch 100, Adam;
* ``cnn``: the MNIST CNN of ``examples/mnist_cnn.py`` (1.66 M parameters), batch 64, SGD momentum 0.9;
* ``mlp25m``: an MLP 784-4096-4096-1280-10 (25.3 M parameters), batch 256, Adam; 1 and 4 ps (several ps:
  ``GreedyByBytes`` and every large variable split over all of them, as a user would place it);
* ``ctr``: click-through: one ``EmbeddingTable`` ("ids", 10 M ids, dim 16, ``pooling="sum"``, Adagrad
  lr 0.05 per row on the ps), 8 ids per sample drawn uniformly from the 10 M, batch 4096, and an MLP head
  16-256-64-1 on the device (Adam), BCE-with-logits; 1, 2 and 4 ps, against two references written by
  hand: the table on the device (``nn.EmbeddingBag(10M, 16, mode="sum", sparse=True)``, sparse Adagrad on
  the device), and the table in host memory with the head on the device, in two forms: *rows to device*
  (the batch's unique ids and inverse map on the host, their rows gathered on the host into a pinned
  buffer, copied to the device, pooled there; the rows' gradients copied back, a sparse Adagrad step on
  the host) and *pooled to device* (``nn.EmbeddingBag`` on the host, its pooled output ``.to(device)``,
  autograd carrying the gradient back).  Samples/s, and each tensorfleet figure's ratio to each reference.

The dense jobs (mlp, cnn, mlp25m) also run in hybrid mode (issue 40: ``dense="allreduce"``, the parameters stay
on the device, one ps keeps the global step), against issue 40's target of 0.9x plain PyTorch.

The tensorfleet loop is what a user writes: the model built, ``.to(device)``, ``tfl.Replica(model, cluster,
task, optimizer=..., overlap=..., prefetch=...)``, then ``pull()``, forward, backward, ``push()``.  For the
table, the batch's ids are moved to the device with the rest of the batch and the forward gets them there
(``EmbeddingTable`` routes ids on the host and gives rows on the ids' device: the rows go to the device, their
gradients come back); the loop hands the host copy of the ids it has to ``replica.prefetch_rows`` (one
request per shard, the unique ids computed once, on the host).  ``--ctr-ids host`` gives the forward the host
ids instead (rows pooled on the host, the pooled batch moved to the device).  With prefetch on, the next
batch's rows are asked for right after this step's forward (async mode: they are one update older).

Variants: overlap (each gradient leaves during backward) and prefetch (a push travels during the next step)
off and on (``--overlap``, ``--prefetch``: off, on or both, the default; the click-through job's head has
17 k parameters: overlap stays off there unless ``--overlap on``).  Every configuration of a job is built
first (its ps started, its replica initialized); then one untimed warm-up block each, then ``--repeats``
rounds in which every configuration runs one timed block in turn (interleaved: drift hits each alike).
A block is ``--steps`` steps (per job by default: mlp 500, cnn 300, mlp25m 30, ctr 100), cut short once it
passes ``--max-block-s`` seconds (the figure is then of the steps it ran; the JSON keeps each block's
count), ended by ``replica.settle()`` (a prefetching push's reply is part of the work) and a device
synchronize.  Figures are medians over the rounds; ratios are of medians.  Synthetic data, generated and
moved to the device before the clock starts (a few batches, cycled).  Every ps and this worker run one
intra-op thread (``--threads``), as the tasks ``tensorfleet launch`` starts do; the data connections poll as
launch sets them up (``busy_poll_for``: when every task has a core).  Rounds stop early (never below one) once
the run passes ``--budget-s`` seconds; each job's figures are written to ``--json`` as soon as it ends, so a
run cut short keeps the jobs it finished.  A configuration that fails is reported with its error and the run
goes on; the exit status is then 1.

    python benchmarks/gpu.py [--device cuda] [--jobs mlp,cnn,mlp25m,ctr] [--repeats 3] [--json gpu.json]
    python benchmarks/gpu.py --device cpu --smoke     # tiny sizes, a few steps: well under 2 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import tensorfleet as tfl  # noqa: E402
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec  # noqa: E402
from tensorfleet.backends.local import with_launcher_death  # noqa: E402
from tensorfleet.cluster.machine import busy_poll_for  # noqa: E402
from tensorfleet.cluster.ports import local_cluster  # noqa: E402
from tensorfleet.wire import auth  # noqa: E402
from tensorfleet.wire.rpc import BUSY_POLL_ENV, WireOptions  # noqa: E402
from mnist_cnn import ConvNet  # noqa: E402
from mnist_mlp import build_model as seed_mlp  # noqa: E402

JOBS = ("mlp", "cnn", "mlp25m", "ctr")
# Issue 39's targets: job -> (ps count, at least this ratio to plain PyTorch); click-through: (reference, ps
# count, ratio), the reference being the faster hand-written host-table one, or the table on the device.
TARGETS = {"mlp": (1, 0.8), "cnn": (1, 0.5), "mlp25m": (4, 0.1)}
CTR_TARGETS = (("host", 1, 1.0), ("device", 4, 0.5))
TABLE_LR, DENSE_LR, CNN_LR, MOMENTUM = 0.05, 1e-3, 0.01, 0.9
INIT_STD = 0.01  # the ps's RowInitializer default, and the references' tables
WIDE = (4096, 4096, 1280)  # mlp25m's hidden layers: 25.3 M parameters
HEAD = (256, 64)


# --- sizes -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Sizes:
    steps: dict[str, int]
    batch: dict[str, int]
    wide: tuple[int, ...] = WIDE
    num_ids: int = 10_000_000
    dim: int = 16
    ids_per_sample: int = 8
    batches: int = 8  # distinct batches, cycled


def sizes_of(args: argparse.Namespace) -> Sizes:
    if args.smoke:
        sizes = Sizes(steps={"mlp": 20, "cnn": 4, "mlp25m": 4, "ctr": 5},
                      batch={"mlp": 100, "cnn": 16, "mlp25m": 32, "ctr": 512}, wide=(256, 256, 128),
                      num_ids=100_000, batches=3)
    else:
        sizes = Sizes(steps={"mlp": 500, "cnn": 300, "mlp25m": 30, "ctr": 100},
                      batch={"mlp": 100, "cnn": 64, "mlp25m": 256, "ctr": 4096})
    if args.steps:
        sizes.steps = {job: args.steps for job in sizes.steps}
    if args.num_ids:
        sizes.num_ids = args.num_ids
    if args.ctr_batch:
        sizes.batch["ctr"] = args.ctr_batch
    return sizes


# --- the device ------------------------------------------------------------------------------------

class Device:
    def __init__(self, name: str) -> None:
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def describe(self) -> str:
        if self.cuda:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            return (f"{torch.cuda.get_device_name(index)} ({props.total_memory / 2 ** 30:.0f} GiB), "
                    f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
        return f"CPU ({platform.processor() or platform.machine()})"

    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


# --- the ps ----------------------------------------------------------------------------------------

class PsSet:
    """``num_ps`` ps processes (``python -m tensorfleet.ps``) of a cluster of ``num_workers`` workers."""

    def __init__(self, num_ps: int, num_workers: int, busy_poll_us: int, log_prefix: Path | None = None) -> None:
        self.cluster: ClusterSpec = local_cluster(num_ps, num_workers)
        self.num_ps = num_ps
        self.next_worker = 0
        env = {**os.environ, "OMP_NUM_THREADS": "1", BUSY_POLL_ENV: str(busy_poll_us),
               "CUDA_VISIBLE_DEVICES": ""}  # the ps are CPU tasks: no CUDA context there
        env.pop(auth.TOKEN_ENV, None)
        env.pop(auth.TOKEN_FILE_ENV, None)
        self.chief_ok = False  # worker 0 started (initialized the ps): the other workers may start
        self.processes: list[subprocess.Popen] = []
        # Each ps's log (stderr) in a file (a pipe nobody reads could fill up): kept with --ps-logs
        self.logs = [open(f"{log_prefix}-{i}.log", "w+b") if log_prefix else tempfile.TemporaryFile()
                     for i in range(num_ps)]
        for i in range(num_ps):
            command = with_launcher_death([sys.executable, "-m", "tensorfleet.ps"])  # dies with this process
            self.processes.append(subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=self.logs[i],
                env={**env, "TF_CONFIG": self.cluster.to_tf_config(TaskSpec("ps", i))}))

    def worker(self) -> TaskSpec:
        """The next worker task of the cluster (worker 0, the chief, first: it initializes the ps)."""
        task = TaskSpec("worker", self.next_worker)
        self.next_worker += 1
        return task

    def dead(self) -> str | None:
        """A line on the first ps that has exited (its last stderr line), or None."""
        for i, process in enumerate(self.processes):
            if process.poll() is not None:
                self.logs[i].seek(0)
                err = self.logs[i].read().decode(errors="replace").strip().splitlines()
                return f"ps {i} exited with {process.returncode}: {err[-1] if err else '(no output)'}"
        return None


def close_all(ps_sets: list[PsSet], wait_s: float) -> None:
    """Wait up to ``wait_s`` for every ps to exit (they do once every worker said done), then kill."""
    deadline = time.monotonic() + wait_s
    for ps in ps_sets:
        for process in ps.processes:
            try:
                process.wait(timeout=max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    for ps in ps_sets:
        for log in ps.logs:
            log.close()


def stop_ps(ps_sets: list[PsSet], configs: list["Config"]) -> Callable[..., bool]:
    """For ``ExitStack.push``: on a normal exit every replica finishes (says done) and the ps exit, all
    together; on an error or an interrupt the ps are killed first, then the replicas closed."""
    def exit_(exc_type: type | None, *_: Any) -> bool:
        if exc_type is not None:
            close_all(ps_sets, 0.0)
        else:  # ps whose chief never started wait for workers that will never come
            close_all([ps for ps in ps_sets if not ps.chief_ok], 0.0)
        for config in configs:
            if config.replica is not None:
                try:
                    config.replica.finish(done=exc_type is None)
                except Exception as exc:  # noqa: BLE001
                    print(f"  finishing {config.name}: {one_line(exc)}", file=sys.stderr)
                config.replica = None
        close_all(ps_sets, 15.0)
        return False
    return exit_


def start_ps(ps_counts: tuple[int, ...], workers: int, configs: list["Config"], stack: contextlib.ExitStack,
             args: argparse.Namespace, job: str) -> tuple[int, list[PsSet]]:
    """(the polling budget, a PsSet of each count), every ps process started now; ``stack`` stops them."""
    poll = busy_poll_for(sum(ps_counts) + 1)  # as launch sets it up for these tasks on this machine
    ps_sets: list[PsSet] = []
    stack.push(stop_ps(ps_sets, configs))
    for num_ps in ps_counts:
        prefix = Path(args.ps_logs) / f"{job}-{num_ps}ps" if args.ps_logs else None
        ps_sets.append(PsSet(num_ps, workers, poll, prefix))
    return poll, ps_sets


# --- configurations --------------------------------------------------------------------------------

@dataclasses.dataclass
class Config:
    """One way of training a job's model: ``step(i)`` runs training step i; ``settle()`` ends a block."""

    name: str
    kind: str  # "reference" or "tensorfleet"
    num_ps: int = 0
    overlap: bool = False
    prefetch: bool = False
    step: Callable[[int], None] | None = None
    ps: PsSet | None = None
    replica: Any = None  # a tfl.Replica
    rates: list[float] = dataclasses.field(default_factory=list)  # steps/s, one per timed block
    steps_timed: list[int] = dataclasses.field(default_factory=list)
    error: str | None = None
    counter: int = 0  # the next step's index: blocks continue the sequence of batches

    def median(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None


def variants(args: argparse.Namespace, *, ctr: bool) -> list[tuple[bool, bool]]:
    choices = {"off": [False], "on": [True], "both": [False, True]}
    overlaps = choices[args.overlap] if not (ctr and args.overlap == "both") else [False]
    return list(itertools.product(overlaps, choices[args.prefetch]))


def tf_name(num_ps: int, overlap: bool, prefetch: bool) -> str:
    extra = "+".join(word for word, on in (("overlap", overlap), ("prefetch", prefetch)) if on)
    return f"tensorfleet, {num_ps} ps" + (f", {extra}" if extra else "")


def make_replica(model: nn.Module, ps: PsSet, optimizer: tfl.OptimizerSpec, config: Config,
                 busy_poll_us: int, dense: str = "ps") -> tfl.Replica:
    if ps.next_worker > 0 and not ps.chief_ok:  # it would wait out its init timeout for the chief
        raise RuntimeError("the chief (worker 0) of these ps failed to start: see above")
    dead = ps.dead()
    if dead:
        raise RuntimeError(dead)
    num_ps = len(ps.cluster.ps_addresses)
    spread = ({"placement": tfl.GreedyByBytes(), "partitioner": tfl.RowPartitioner(num_parts=num_ps, min_bytes=1 << 20)}
              if num_ps > 1 else {})  # several ps: large variables split over all of them, as a user would
    replica = tfl.Replica(model, ps.cluster, ps.worker(), optimizer=optimizer, overlap=config.overlap,
                          prefetch=config.prefetch, wire=WireOptions(busy_poll_us=busy_poll_us),
                          init_timeout_s=60.0, dense=dense, **spread)
    config.replica = replica
    replica.start()
    if replica.is_chief:
        ps.chief_ok = True
    return replica


# --- the dense jobs ------------------------------------------------------------------------------------

def wide_mlp(widths: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = []
    width = 784
    for hidden in widths:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, 10))


def dense_job(job: str, sizes: Sizes) -> tuple[str, Callable[[], nn.Module], Callable[[nn.Module], Any],
                                               tfl.OptimizerSpec]:
    """(description, model builder, torch optimizer of a model, the ps's optimizer)."""
    if job == "mlp":
        return ("seed MLP 784-100-10, Adam", lambda: seed_mlp(100),
                lambda m: torch.optim.Adam(m.parameters(), lr=DENSE_LR), tfl.OptimizerSpec.adam(lr=DENSE_LR))
    if job == "cnn":
        return ("MNIST CNN (examples/mnist_cnn.py), SGD momentum 0.9", ConvNet,
                lambda m: torch.optim.SGD(m.parameters(), lr=CNN_LR, momentum=MOMENTUM),
                tfl.OptimizerSpec.sgd(lr=CNN_LR, momentum=MOMENTUM))
    return (f"MLP 784-{'-'.join(map(str, sizes.wide))}-10, Adam", lambda: wide_mlp(sizes.wide),
            lambda m: torch.optim.Adam(m.parameters(), lr=DENSE_LR), tfl.OptimizerSpec.adam(lr=DENSE_LR))


def dense_configs(job: str, args: argparse.Namespace, sizes: Sizes, dev: Device,
                  stack: contextlib.ExitStack) -> tuple[str, int, list[Config]]:
    description, build, torch_optimizer, ps_optimizer = dense_job(job, sizes)
    batch = sizes.batch[job]
    generator = torch.Generator().manual_seed(0)
    data = [(torch.rand(batch, 784, generator=generator).to(dev.device),
             torch.randint(0, 10, (batch,), generator=generator).to(dev.device)) for _ in range(sizes.batches)]
    loss_fn = nn.functional.cross_entropy
    torch.manual_seed(0)
    params = sum(p.numel() for p in build().parameters())

    def reference() -> Config:
        config = Config(f"pytorch on {dev.device.type}", "reference")
        model = build().to(dev.device)
        optimizer = torch_optimizer(model)

        def step(i: int) -> None:
            x, y = data[i % len(data)]
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            optimizer.step()
        config.step = step
        return config

    ps_counts = ((1, 2) if args.smoke else (1, 4)) if job == "mlp25m" else (1,)
    kinds = variants(args, ctr=False)
    configs: list[Config] = []
    poll, ps_sets = start_ps(ps_counts, len(kinds), configs, stack, args, job)  # they boot while the reference is built
    configs.append(guarded(reference, f"pytorch on {dev.device.type}"))
    for ps in ps_sets:
        num_ps = ps.num_ps
        for overlap, prefetch in kinds:
            def tensorfleet(num_ps=num_ps, ps=ps, overlap=overlap, prefetch=prefetch) -> Config:
                config = Config(tf_name(num_ps, overlap, prefetch), "tensorfleet", num_ps, overlap, prefetch, ps=ps)
                torch.manual_seed(0)
                model = build().to(dev.device)
                replica = make_replica(model, ps, ps_optimizer, config, poll)

                def step(i: int) -> None:
                    x, y = data[i % len(data)]
                    replica.pull()
                    loss_fn(model(x), y).backward()
                    replica.push()
                config.step = step
                return config
            configs.append(guarded(tensorfleet, tf_name(num_ps, overlap, prefetch), ps))

    # Hybrid (issue 40): the dense parameters stay on the device (one worker: its all-reduce is over itself),
    # the ps keeps the global step only. A ps set of its own: a hybrid group is every worker of its cluster.
    hybrid_ps = PsSet(1, 1, poll, Path(args.ps_logs) / f"{job}-hybrid" if args.ps_logs else None)
    ps_sets.append(hybrid_ps)

    def hybrid() -> Config:
        config = Config("tensorfleet hybrid (dense by all-reduce)", "hybrid", 1, ps=hybrid_ps)
        torch.manual_seed(0)
        model = build().to(dev.device)
        replica = make_replica(model, hybrid_ps, ps_optimizer, config, poll, dense="allreduce")

        def step(i: int) -> None:
            x, y = data[i % len(data)]
            replica.pull()
            loss_fn(model(x), y).backward()
            replica.push()
        config.step = step
        return config
    configs.append(guarded(hybrid, "tensorfleet hybrid (dense by all-reduce)", hybrid_ps))
    return f"{description}: {params:,} parameters, batch {batch}", batch, configs


# --- click-through ---------------------------------------------------------------------------------

class CtrNet(nn.Module):
    """A table of bags (``ids`` [batch, ids per sample], summed) and an MLP head on the pooled rows."""

    def __init__(self, table: nn.Module, dim: int) -> None:
        super().__init__()
        self.table = table
        layers: list[nn.Module] = []
        width = dim
        for hidden in HEAD:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.head = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = self.table(ids)
        return self.head(pooled.to(self.head[0].weight.device)).squeeze(1)


def host_bag(sizes: Sizes) -> nn.EmbeddingBag:
    bag = nn.EmbeddingBag(sizes.num_ids, sizes.dim, mode="sum", sparse=True)
    with torch.no_grad():
        bag.weight.normal_(0.0, INIT_STD)
    return bag


def ctr_configs(args: argparse.Namespace, sizes: Sizes, dev: Device,
                stack: contextlib.ExitStack) -> tuple[str, int, list[Config]]:
    batch, per = sizes.batch["ctr"], sizes.ids_per_sample
    generator = torch.Generator().manual_seed(0)
    host = [(torch.randint(0, sizes.num_ids, (batch, per), generator=generator),
             torch.randint(0, 2, (batch,), generator=generator).float()) for _ in range(sizes.batches)]
    data = [(ids, ids.to(dev.device), labels.to(dev.device)) for ids, labels in host]  # (host ids, ids, labels)
    loss_fn = nn.functional.binary_cross_entropy_with_logits
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    where = dev.device.type

    def bag_reference(name: str, model: CtrNet, *, host_ids: bool) -> Config:
        """A whole EmbeddingBag model, sparse Adagrad on its table and Adam on its head; ``host_ids``: the batch's
        ids as the host has them (the table in host memory), else as moved to the device."""
        config = Config(name, "reference")
        tables = torch.optim.Adagrad(model.table.parameters(), lr=TABLE_LR)
        head = torch.optim.Adam(model.head.parameters(), lr=DENSE_LR)

        def step(i: int) -> None:
            on_host, on_device, labels = data[i % len(data)]
            tables.zero_grad(set_to_none=True)
            head.zero_grad(set_to_none=True)
            loss_fn(model(on_host if host_ids else on_device), labels).backward()
            tables.step()
            head.step()
        config.step = step
        return config

    def on_device() -> Config:
        torch.manual_seed(0)
        return bag_reference(f"ref: table on {where}", CtrNet(host_bag(sizes), sizes.dim).to(dev.device),
                             host_ids=False)

    def pooled_to_device() -> Config:
        torch.manual_seed(0)
        model = CtrNet(host_bag(sizes), sizes.dim)
        model.head.to(dev.device)
        return bag_reference(f"ref: host table, pooled->{where}", model, host_ids=True)

    def rows_to_device() -> Config:
        config = Config(f"ref: host table, rows->{where}", "reference")
        torch.manual_seed(0)
        weight = nn.Parameter(host_bag(sizes).weight.detach())
        head_model = CtrNet(nn.Identity(), sizes.dim).head.to(dev.device)
        tables = torch.optim.Adagrad([weight], lr=TABLE_LR)
        head = torch.optim.Adam(head_model.parameters(), lr=DENSE_LR)
        staging = torch.empty((batch * per, sizes.dim), pin_memory=dev.cuda)  # reused: never allocated per step

        def step(i: int) -> None:
            ids, _, labels = data[i % len(data)]
            unique, inverse = torch.unique(ids, return_inverse=True)
            rows = staging[:unique.numel()]
            torch.index_select(weight.detach(), 0, unique, out=rows)
            rows_dev = rows.to(dev.device, non_blocking=True, copy=True).requires_grad_(True)
            pooled = nn.functional.embedding_bag(inverse.to(dev.device, non_blocking=True), rows_dev, mode="sum")
            head.zero_grad(set_to_none=True)
            loss_fn(head_model(pooled).squeeze(1), labels).backward()
            head.step()
            weight.grad = torch.sparse_coo_tensor(unique.unsqueeze(0), rows_dev.grad.cpu(), weight.shape)
            tables.step()
        config.step = step
        return config

    kinds = variants(args, ctr=True)
    configs: list[Config] = []
    poll, ps_sets = start_ps((1, 2) if args.smoke else (1, 2, 4), len(kinds), configs, stack,
                              args, "ctr")
    configs += [guarded(on_device, f"ref: table on {where}"),  # built while the ps boot
                guarded(rows_to_device, f"ref: host table, rows->{where}"),
                guarded(pooled_to_device, f"ref: host table, pooled->{where}")]
    adagrad = tfl.OptimizerSpec("adagrad", {"lr": TABLE_LR})
    for ps in ps_sets:
        num_ps = ps.num_ps
        for overlap, prefetch in kinds:
            def tensorfleet(num_ps=num_ps, ps=ps, overlap=overlap, prefetch=prefetch) -> Config:
                config = Config(tf_name(num_ps, overlap, prefetch), "tensorfleet", num_ps, overlap, prefetch, ps=ps)
                torch.manual_seed(0)
                table = tfl.EmbeddingTable("ids", sizes.dim, num_rows=sizes.num_ids, pooling="sum",
                                           optimizer=adagrad)
                model = CtrNet(table, sizes.dim).to(dev.device)
                replica = make_replica(model, ps, tfl.OptimizerSpec.adam(lr=DENSE_LR), config, poll)
                forward_ids = 0 if args.ctr_ids == "host" else 1

                def step(i: int) -> None:
                    batch_i = data[i % len(data)]
                    replica.pull()
                    if not prefetch:  # this batch's rows: one request per shard
                        replica.prefetch_rows({"ids": batch_i[0]})
                    loss = loss_fn(model(batch_i[forward_ids]), batch_i[2])
                    if prefetch:  # the next batch's rows travel while this one computes (async mode)
                        replica.prefetch_rows({"ids": data[(i + 1) % len(data)][0]})
                    loss.backward()
                    replica.push()
                config.step = step
                return config
            configs.append(guarded(tensorfleet, tf_name(num_ps, overlap, prefetch), ps))
    unique = statistics.mean(torch.unique(ids).numel() for ids, _ in host)
    description = (f"click-through: EmbeddingTable {sizes.num_ids:,} ids x dim {sizes.dim}, {per} ids/sample summed "
                   f"(~{unique:,.0f} unique ids a batch), head {sizes.dim}-{'-'.join(map(str, HEAD))}-1, "
                   f"batch {batch}; ctr ids to the forward on the {args.ctr_ids}")
    return description, batch, configs


# --- building and timing ----------------------------------------------------------------------------

def guarded(build: Callable[[], Config], name: str, ps: PsSet | None = None) -> Config:
    """``build()``, or a Config holding the error it raised (the run goes on without it)."""
    start = time.monotonic()
    try:
        config = build()
        print(f"  ready: {name} ({time.monotonic() - start:.1f} s)", flush=True)
        return config
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        config = Config(name, "tensorfleet" if ps else "reference", ps.num_ps if ps else 0, ps=ps)
        config.error = one_line(exc) + (f" [{ps.dead()}]" if ps and ps.dead() else "")
        traceback.print_exc()
        return config


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def block(config: Config, steps: int, max_s: float, dev: Device) -> tuple[float, int]:
    """(steps/s, steps run) of one block: up to ``steps`` steps, cut short after ``max_s`` seconds."""
    dev.sync()
    start = time.perf_counter()
    done = 0
    while done < steps:
        config.step(config.counter)
        config.counter += 1
        done += 1
        if time.perf_counter() - start > max_s:
            break
    if config.replica is not None:
        config.replica.settle()
    dev.sync()
    return done / (time.perf_counter() - start), done


def measure(configs: list[Config], steps: int, warmup: int, args: argparse.Namespace, dev: Device,
            deadline: float) -> None:
    for config in configs:
        if config.error is None:
            run_block(config, warmup, args.max_block_s / 2, dev, record=False)
    for round_ in range(args.repeats):
        if round_ > 0 and time.monotonic() > deadline:
            print(f"  (--budget-s passed: {round_} round(s) of {args.repeats})")
            break
        for config in configs:
            if config.error is None:
                run_block(config, steps, args.max_block_s, dev, record=True)


def run_block(config: Config, steps: int, max_s: float, dev: Device, *, record: bool) -> None:
    try:
        rate, done = block(config, steps, max_s, dev)
    except Exception as exc:  # noqa: BLE001 - the configuration is dropped, the others go on
        traceback.print_exc()
        config.error = one_line(exc)
        return
    if record:
        config.rates.append(rate)
        config.steps_timed.append(done)


# --- report ----------------------------------------------------------------------------------------

def report(job: str, description: str, batch: int, configs: list[Config]) -> dict[str, Any]:
    references = [c for c in configs if c.kind == "reference"]
    result: dict[str, Any] = {"description": description, "batch_size": batch, "configs": {}, "ratios": {}}
    for config in configs:
        median = config.median()
        result["configs"][config.name] = {
            "kind": config.kind, "num_ps": config.num_ps, "overlap": config.overlap, "prefetch": config.prefetch,
            "steps_per_sec": median, "samples_per_sec": None if median is None else median * batch,
            "steps_per_sec_rounds": config.rates, "steps_timed": config.steps_timed, "error": config.error}
        for ref in references:
            if config is not ref and median and ref.median():
                result["ratios"].setdefault(config.name, {})[ref.name] = median / ref.median()
    print(f"\n== {job}: {description}")
    width = max(len("vs " + short(r.name)) for r in references) + 2
    heads = "".join(f"{'vs ' + short(r.name):>{width}}" for r in references)
    print(f"{'configuration':<44}{'steps/s':>10}{'samples/s':>13}{heads}")
    for config in configs:
        median = config.median()
        if median is None:
            print(f"{config.name:<44}  FAILED: {config.error}")
            continue
        cells = "".join(f"{median / r.median():>{width - 1}.3f}x" if r.median() else f"{'-':>{width}}"
                        for r in references)
        note = f"  (then failed: {config.error})" if config.error else ""
        print(f"{config.name:<44}{median:>10.1f}{median * batch:>13,.0f}{cells}{note}")
    return result


def short(name: str) -> str:
    return name.removeprefix("ref: ")


def targets(results: dict[str, Any]) -> list[str]:
    """Issue 39's targets, each against the best variant with that many ps."""
    lines = []

    def best(job: dict[str, Any], num_ps: int) -> tuple[str, float] | None:
        rates = [(name, c["steps_per_sec"]) for name, c in job["configs"].items()
                 if c["kind"] == "tensorfleet" and c["num_ps"] == num_ps and c["steps_per_sec"]]
        return max(rates, key=lambda r: r[1]) if rates else None

    for job, (num_ps, goal) in TARGETS.items():
        if job not in results or "configs" not in results[job]:
            continue
        ref = next((c for c in results[job]["configs"].values() if c["kind"] == "reference"), None)
        top = best(results[job], num_ps)
        if ref and ref["steps_per_sec"] and top:
            ratio = top[1] / ref["steps_per_sec"]
            lines.append(f"{job:<7} {ratio:6.3f}x pytorch with {num_ps} ps ({top[0]}), target >= {goal}x: "
                         f"{'met' if ratio >= goal else 'MISSED'}")
    for job in ("mlp25m", "cnn"):  # issue 40: the dense part by all-reduce, >= 0.9x plain PyTorch on the GPU
        configs = results.get(job, {}).get("configs", {})
        ref = next((c for c in configs.values() if c["kind"] == "reference"), None)
        hybrid = next((c for c in configs.values() if c["kind"] == "hybrid"), None)
        if ref and ref["steps_per_sec"] and hybrid and hybrid["steps_per_sec"]:
            ratio = hybrid["steps_per_sec"] / ref["steps_per_sec"]
            lines.append(f"{job:<7} {ratio:6.3f}x pytorch hybrid (issue 40), target >= 0.9x: "
                         f"{'met' if ratio >= 0.9 else 'MISSED'}")
    job = results.get("ctr")
    if job and "configs" in job:
        refs = {name: c["steps_per_sec"] for name, c in job["configs"].items()
                if c["kind"] == "reference" and c["steps_per_sec"]}
        host = [(rate, name) for name, rate in refs.items() if "host table" in name]
        device = [(rate, name) for name, rate in refs.items() if "host table" not in name]
        for kind, num_ps, goal in CTR_TARGETS:
            pool = host if kind == "host" else device
            top = best(job, num_ps)
            if pool and top:
                rate, name = max(pool)  # the faster hand-written reference of that kind
                ratio = top[1] / rate
                lines.append(f"ctr     {ratio:6.3f}x '{short(name)}' with {num_ps} ps ({top[0]}), target >= {goal}x: "
                             f"{'met' if ratio >= goal else 'MISSED'}")
    return lines


def run_job(job: str, args: argparse.Namespace, sizes: Sizes, dev: Device, deadline: float) -> dict[str, Any]:
    """Start the job's ps, build its configurations, measure them, finish them and stop the ps; the report."""
    marks = [time.monotonic()]
    with contextlib.ExitStack() as stack:
        if job == "ctr":
            description, batch, configs = ctr_configs(args, sizes, dev, stack)
        else:
            description, batch, configs = dense_configs(job, args, sizes, dev, stack)
        marks.append(time.monotonic())
        steps = sizes.steps[job]
        warmup = args.warmup if args.warmup is not None else max(3, steps // 10)
        measure(configs, steps, warmup, args, dev, deadline)
        marks.append(time.monotonic())
    marks.append(time.monotonic())
    result = report(job, description, batch, configs)
    result["phases_s"] = dict(zip(("start", "measure", "stop"), (b - a for a, b in zip(marks, marks[1:]))))
    print("  (" + ", ".join(f"{k} {v:.1f} s" for k, v in result["phases_s"].items()) + ")")
    return result


# --- main ------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model computes (default: cuda when there is one)")
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {','.join(JOBS)}")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per timed block, every job (default: mlp 500, cnn 300, mlp25m 30, ctr 100)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per configuration (default: "
                        "a tenth of the steps, at least 3)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 3; --smoke 1)")
    parser.add_argument("--max-block-s", type=float, default=1.5, help="cut a timed block after this long")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="no new round once the run has taken this long (every job gets one)")
    parser.add_argument("--overlap", choices=["off", "on", "both"], default="both")
    parser.add_argument("--prefetch", choices=["off", "on", "both"], default="both")
    parser.add_argument("--ctr-ids", choices=["device", "host"], default="device",
                        help="where the click-through forward gets its ids (prefetch_rows gets the host copy)")
    parser.add_argument("--num-ids", type=int, default=None, help="click-through table size (default 10M; "
                        "--smoke 100k)")
    parser.add_argument("--ctr-batch", type=int, default=None, help="click-through batch (default 4096; --smoke 512)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of this process")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and a few steps (a check that it runs)")
    parser.add_argument("--json", default=None, help="write the figures to this file (after each job)")
    parser.add_argument("--ps-logs", default=None, help="keep each ps's log in this folder (JOB-Nps-I.log)")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 3
    unknown = set(args.jobs.split(",")) - set(JOBS)
    if unknown:
        parser.error(f"--jobs: unknown {sorted(unknown)}; use some of {','.join(JOBS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ps_logs:
        Path(args.ps_logs).mkdir(parents=True, exist_ok=True)
    # `timeout` ends a run with SIGTERM: leave as on an error (the ps killed, the replicas closed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    deadline = started + args.budget_s
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    dev = Device(args.device)
    sizes = sizes_of(args)
    header = {"device": str(dev.device), "device_name": dev.describe(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(), "cpu_cores": os.cpu_count(),
              "threads": args.threads, "smoke": args.smoke, "repeats": args.repeats, "steps": sizes.steps,
              "max_block_s": args.max_block_s, "ctr_ids": args.ctr_ids}
    print(f"device: {header['device']}: {header['device_name']}; torch {torch.__version__}, python "
          f"{header['python']}, {os.cpu_count()} cores, {args.threads} intra-op thread(s) here, 1 per ps")
    print(f"medians of {args.repeats} interleaved round(s); blocks of {sizes.steps} steps, cut at "
          f"{args.max_block_s} s{'; SMOKE sizes' if args.smoke else ''}")
    results: dict[str, Any] = {"header": header, "jobs": {}}
    failed = False
    for job in args.jobs.split(","):
        job_start = time.monotonic()
        try:
            results["jobs"][job] = run_job(job, args, sizes, dev, deadline)
            failed |= any(c["error"] for c in results["jobs"][job]["configs"].values())
        except Exception as exc:  # noqa: BLE001 - the next job still runs
            traceback.print_exc()
            results["jobs"][job] = {"error": one_line(exc)}
            failed = True
        gc.collect()  # the job's models and tables, before the next job's
        dev.empty_cache()
        results["jobs"][job]["seconds"] = time.monotonic() - job_start
        print(f"  ({job}: {time.monotonic() - job_start:.0f} s)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    lines = targets(results["jobs"])
    if lines:
        print("\nissue 39 and 40 targets (best variant; compare on a GPU machine only):")
        for line in lines:
            print("  " + line)
    results["targets"] = lines
    results["seconds"] = time.monotonic() - started
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"total {results['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
