"""The hybrid: a worker's towers average locally, then tower 0 alone talks to the ps.

A worker machine with K devices is one replica of the job: the ps sees one push
per worker and step (M pushes for M workers, not M*K), as a worker with one device
would send. ``TowerReplica`` is built around a ``Replica`` (composition, no change to
it) and implements the same ``TrainingReplica`` protocol, so ``TrainingSession`` and its
hooks drive it unchanged. Every tower calls the same verbs in the same order (SPMD);
only tower 0 has ps connections:

1. ``pull()``: tower 0 pulls (free right after its push, which brought the new
   values back) and broadcasts a small header (global step, or tower 0's failure)
   and then the parameters to the other towers.
2. Every tower runs forward and backward on its slice of the batch, through
   ``replica.model`` (torch's DDP): backward leaves the towers' average gradient in
   every tower's parameters. (A forward that bypassed it is caught at ``push()``,
   which then averages with one all-reduce.)
3. ``push()``: tower 0 pushes the average once; the ps applies it (async) or folds
   it into the step's mean (sync); the reply's values land in tower 0's parameters.
   Tower 0 broadcasts the header (the new global step) so every tower's hooks,
   ``StopAtStepHook`` included, decide alike. The next ``pull()`` broadcasts the values.

Embedding tables: a table's forward on any tower is a collective; the towers gather their
ids, tower 0 looks up the union once and broadcasts the rows. ``push()`` gathers every
tower's row gradients, sums them per id and divides by the towers (DDP's average), and
tower 0 sends them in its one push.

When tower 0 fails (a ps went away), the header carries the error's class, every
tower raises it, and ``TrainingSession`` recovers on every tower in step: tower 0
waits for the ps (``Replica.recover``) and broadcasts the restored values.

On GPUs, tower 0's ``Replica`` is over tower 0's module on its device, as any ``Replica`` over a device model
(``worker/staging.py``): values and gradients cross between the device and pinned host buffers with one
non-blocking copy each way, and the towers' broadcast starts from tower 0's device.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar, overload

import torch
from torch import nn

from tensorfleet.cluster.placement import Placement, PlacementStrategy, RowPartitioner
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec
from tensorfleet.errors import (DeadlineExceededError, InvalidArgumentError, NotInitializedError, TensorfleetError,
                                UnavailableError)
from tensorfleet.parallel.towers import Towers
from tensorfleet.protocol.specs import Mode, OptimizerSpec, SyncOptions
from tensorfleet.protocol.state import ShardState
from tensorfleet.wire.rpc import WireOptions
from tensorfleet.worker.client import PsClient
from tensorfleet.worker.embedding import tables_of
from tensorfleet.worker.options import DEFAULT_PLACEMENT, ReplicaOptions
from tensorfleet.worker.training_replica import ended_cleanly
from tensorfleet.worker.replica import Replica

# What tower 0's failure becomes on the other towers: the recoverable ones keep their class, so
# TrainingSession's recovery runs on every tower alike.
_FAILURES: tuple[type[TensorfleetError], ...] = (UnavailableError, NotInitializedError, DeadlineExceededError,
                                                  TensorfleetError)


def _failure_kind(exc: BaseException) -> int:
    """Tower 0's error as the header's code: 1 + its index in ``_FAILURES`` (any other error: the last)."""
    return 1 + next((i for i, cls in enumerate(_FAILURES) if isinstance(exc, cls)), len(_FAILURES) - 1)


T = TypeVar("T")


class _OnTower0(Generic[T]):
    """An attribute of tower 0's ``Replica``, read through the ``TowerReplica`` (the other towers have none)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, instance: None, owner: type) -> _OnTower0[T]: ...

    @overload
    def __get__(self, instance: TowerReplica, owner: type) -> T: ...

    def __get__(self, instance: TowerReplica | None, owner: type) -> T | _OnTower0[T]:
        if instance is None:
            return self
        return getattr(instance._tower_0(self._name), self._name)


class TowerReplica:
    """A worker's towers bound to the ps: the verbs of ``Replica``, one push per worker and step.

    Args:
        towers: this tower's ``Towers`` (from ``run_towers``).
        module: the model, already on ``towers.device``; tower 0's initial values are what the chief sends.
        cluster, task: the cluster and this worker's task (the same on every tower of the worker).
        optimizer, mode, ..., prefetch, config: ``Replica``'s keyword arguments (see ``training_options``), used
            by tower 0 and checked on every tower. ``overlap=True`` is refused with several towers: it would
            stream each gradient before the towers have averaged it; so is ``prefetch=True``.

    Attributes:
        options: the ``ReplicaOptions`` (every tower).
        replica: tower 0's ``Replica`` (None on the other towers). Its ps side (``client``, ``placement``,
            ``optimizer``, ``mode``, ``sync``, ``settle()``, ...) is readable here on tower 0; the other towers
            raise ``AttributeError`` for it.
        model: forward through this (``DistributedDataParallel`` around ``module``; ``module`` itself
            for one tower): its backward averages the gradients over the towers.

    Example:
        >>> def train(towers, args, cluster, task):  # doctest: +SKIP
        ...     model = Net().to(towers.device)
        ...     replica = TowerReplica(towers, model, cluster, task, optimizer=OptimizerSpec.sgd(lr=0.1))
        ...     with TrainingSession(replica, hooks=[StopAtStepHook(last_step=1000)]) as session:
        ...         while not session.should_stop():
        ...             x, y = towers.split(*next(data))
        ...             session.run_step(lambda: loss_fn(replica.model(x), y), batch_size=batch_size)
        >>> run_towers(train, args, cluster, task, options=TowerOptions(num_towers=2))  # doctest: +SKIP
    """

    def __init__(self, towers: Towers, module: nn.Module, cluster: ClusterSpec, task: TaskSpec, *,
                 optimizer: OptimizerSpec, mode: Mode | str = Mode.ASYNC, sync: SyncOptions | None = None,
                 placement: PlacementStrategy = DEFAULT_PLACEMENT, partitioner: RowPartitioner | None = None,
                 average_decay: float | None = None, wire: WireOptions | None = None,
                 init_timeout_s: float = 300.0, log_placement: bool = False, overlap: bool = False,
                 wire_dtype: torch.dtype | None = None, nonfinite_gradients: str = "reject",
                 prefetch: bool = False, dense: str = "ps", config: ReplicaOptions | None = None) -> None:
        # Checked on every tower, so that they all refuse bad options alike; tower 0's Replica uses them.
        self.options = ReplicaOptions.merge(
            config, mode=mode, sync=sync, placement=placement, partitioner=partitioner, average_decay=average_decay,
            wire=wire, init_timeout_s=init_timeout_s, log_placement=log_placement, overlap=overlap,
            wire_dtype=wire_dtype, nonfinite_gradients=nonfinite_gradients, prefetch=prefetch, dense=dense)
        if self.options.dense == "allreduce" and towers.num_towers > 1:
            raise InvalidArgumentError("dense='allreduce' with several towers is not supported: the towers' DDP and "
                                       "the workers' all-reduce would both reduce during backward; run one process "
                                       "per device instead (--workers N, one tower each)")
        if self.options.overlap and towers.num_towers > 1:
            raise InvalidArgumentError("overlap=True streams each gradient during backward, before the towers have "
                                       "averaged it: use towers or --overlap, not both")
        if self.options.prefetch and towers.num_towers > 1:
            raise InvalidArgumentError("prefetch=True with several towers is not supported: the towers take tower "
                                       "0's values after each push; use towers or --prefetch, not both")
        self.towers = towers
        self.module = module
        self.task = task
        self.replica_id = cluster.replica_id(task)
        self.is_chief = cluster.is_chief(task) and towers.index == 0  # tower 0 speaks for the worker
        self.global_step = 0
        self.dropped_gradients = 0
        self._params = [p for p in module.parameters()]
        self._forwarded = False
        self.model = towers.wrap(module)
        if self.model is not module:
            self.model.register_forward_pre_hook(self._on_forward)
        self.replica: Replica | None = None
        if towers.index == 0:  # a device module: its Replica stages values and gradients through host buffers
            self.replica = Replica(module, cluster, task, optimizer=optimizer, config=self.options)
        # Embedding tables: every tower's forward fetches its rows through tower 0 (one lookup of the towers'
        # ids together), and push() merges the towers' row gradients into tower 0's one push.
        self.tables = tables_of(module)
        for table in self.tables.values():
            table.bind(lambda ids, name=table.name: self._lookup_rows(name, ids))

    # --- the ps side: tower 0's Replica ----------------------------------------------------------

    client: _OnTower0[PsClient] = _OnTower0()
    placement: _OnTower0[Placement] = _OnTower0()  # where the variables live (not the placement strategy)
    num_ps: _OnTower0[int] = _OnTower0()
    optimizer: _OnTower0[OptimizerSpec] = _OnTower0()
    mode: _OnTower0[Mode] = _OnTower0()
    sync: _OnTower0[SyncOptions | None] = _OnTower0()
    average_decay: _OnTower0[float | None] = _OnTower0()
    nonfinite_gradients: _OnTower0[str] = _OnTower0()
    init_timeout_s: _OnTower0[float] = _OnTower0()
    overlap: _OnTower0[bool] = _OnTower0()
    prefetch: _OnTower0[bool] = _OnTower0()
    shard_steps: _OnTower0[tuple[int, ...]] = _OnTower0()
    dense_names: _OnTower0[frozenset[str]] = _OnTower0()  # hybrid (one tower): what the workers keep
    dense: _OnTower0[Any] = _OnTower0()

    def dense_state(self) -> Any:
        """Tower 0: ``Replica.dense_state`` (hybrid mode, one tower)."""
        return self._tower_0("dense_state").dense_state()

    def restore_dense(self, values: Any, slots: Any, updates: int, averages: Any = None) -> None:
        """Tower 0: ``Replica.restore_dense`` (hybrid mode, one tower)."""
        self._tower_0("restore_dense").restore_dense(values, slots, updates, averages)

    def settle(self) -> int:
        """Tower 0: ``Replica.settle`` (prefetch, which needs a single tower)."""
        return self._tower_0("settle").settle()

    def _tower_0(self, name: str) -> Replica:
        """Tower 0's ``Replica``; on another tower, the error that says where ``name`` lives."""
        if self.replica is None:
            raise AttributeError(f"{type(self).__name__} has no {name!r} on this tower: the ps side of a worker "
                                 "(client, placement, optimizer, ...) lives on tower 0 only")
        return self.replica

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self, *, restore: Sequence[ShardState] | None = None) -> "TowerReplica":
        """Tower 0 starts its ``Replica`` (chief: initialize or restore the ps); every tower gets its values."""
        self._lead(lambda: self.replica.start(restore=restore), values=True)
        return self

    def recover(self, *, restore: Sequence[ShardState] | None, timeout_s: float) -> None:
        """After a ps was lost: tower 0 recovers (``Replica.recover``); every tower gets the restored values."""
        self.module.zero_grad(set_to_none=True)  # the step runs again from scratch
        for table in self.tables.values():
            table.forget()
        self._lead(lambda: self.replica.recover(restore=restore, timeout_s=timeout_s), values=True)

    def finish(self, *, done: bool = True) -> None:
        """Tower 0 closes its replica (``Replica.finish``: ``done`` says whether training ended cleanly); the
        other towers have nothing to close."""
        if self.replica is not None:
            self.replica.finish(done=done)

    def __enter__(self) -> "TowerReplica":
        return self.start()

    def __exit__(self, exc_type: type | None, *exc_info: Any) -> None:
        self.finish(done=ended_cleanly(exc_type))

    # --- the step --------------------------------------------------------------------------------

    def pull(self) -> int:
        """Every tower's parameters take the ps's current values; return the global step."""
        self._lead(lambda: self.replica.pull(), values=True)
        return self.global_step

    def load_averages(self) -> int:
        """Every tower's parameters take the ps's moving averages (for evaluation); return the global step."""
        self._lead(lambda: self.replica.load_averages(), values=True)
        return self.global_step

    def push(self) -> int:
        """Tower 0 pushes the towers' average gradient (one push for the worker); return the new global step.

        Every tower's gradients are cleared, as ``Replica.push`` clears them.
        """
        if not self._forwarded:  # backward did not run through ``model``: average here instead
            self.towers.average_gradients(self.module)
        self._forwarded = False
        rows = self._merged_rows()
        self._lead(lambda: self._push_from_tower_0(rows), values=False)
        self.module.zero_grad(set_to_none=True)
        return self.global_step

    def report(self, *, loss: float | None = None, examples: int = 0, target_step: int | None = None,
               metrics: Mapping[str, float] | None = None) -> None:
        """Tower 0 answers the task's Status RPC; the other towers' figures are the worker's already."""
        if self.replica is not None:
            self.replica.report(loss=loss, examples=examples, target_step=target_step, metrics=metrics)

    # --- tower 0 leads, the others follow --------------------------------------------------------

    def _push_from_tower_0(self, rows: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
        return self.replica.push(rows=rows if self.tables else None)

    # --- embedding tables: tower 0 fetches and pushes rows for every tower ------------------------

    def _lookup_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """This tower's rows of ``ids`` (unique, CPU): tower 0 looks up the towers' ids together and
        broadcasts the rows; its failure reaches every tower as ``_lead``'s header."""
        union = torch.unique(torch.cat(self.towers.all_gather_rows(ids)))
        found: dict[str, torch.Tensor] = {}
        self._lead(lambda: found.update(self.replica.client.lookup({table: union.cpu()})), values=False)
        rows = found[table].to(self.towers.device) if table in found else torch.empty(
            (union.numel(), self.tables[table].dim), dtype=self.tables[table].dtype, device=self.towers.device)
        self.towers.broadcast([rows])
        return rows[torch.searchsorted(union, ids.to(union.device))].cpu()

    def _merged_rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every tower's row gradients of this step, merged: each id's summed over the towers and divided by
        their number, as DDP averages the dense gradients (tower 0 pushes them; the others get {})."""
        merged = {}
        for name in sorted(self.tables):  # the same order on every tower: these are collectives
            table = self.tables[name]
            taken = table.take_gradients()
            ids, grads = taken if taken is not None else (torch.empty(0, dtype=torch.int64),
                                                          torch.empty((0, table.dim), dtype=table.dtype))
            all_ids = torch.cat(self.towers.all_gather_rows(ids)).cpu()
            all_grads = torch.cat(self.towers.all_gather_rows(grads)).cpu()
            if self.replica is None or not all_ids.numel():
                continue
            unique, inverse = torch.unique(all_ids, return_inverse=True)
            total = torch.zeros((unique.numel(), table.dim), dtype=all_grads.dtype).index_add_(0, inverse, all_grads)
            merged[name] = (unique, total.div_(self.towers.num_towers))
        return merged

    def _on_forward(self, _module: nn.Module, _inputs: Any) -> None:
        if torch.is_grad_enabled():
            self._forwarded = True  # DDP's backward will average the gradients

    def _lead(self, action: Callable[[], Any], *, values: bool) -> None:
        """Tower 0 runs ``action``; every tower learns how it went and, with ``values``, gets the parameters."""
        header = torch.zeros(3, dtype=torch.int64, device=self.towers.device)
        if self.replica is not None:
            try:
                action()
            except BaseException as exc:
                header[0] = _failure_kind(exc)
                with contextlib.suppress(Exception):  # the others may be gone: tower 0's own error is the news
                    self.towers.broadcast([header])
                raise
            header[1], header[2] = self.replica.global_step, self.replica.dropped_gradients
        self.towers.broadcast([header])
        failure, self.global_step, self.dropped_gradients = (int(v) for v in header.tolist())
        if failure:
            cls = _FAILURES[failure - 1]
            raise cls(f"tower 0 of {self.task.name} failed ({cls.__name__}); its log has the cause",
                      task=self.task.name, step=self.global_step)
        if values:
            self._share_values()

    def _share_values(self) -> None:
        self.towers.broadcast(self._params)
