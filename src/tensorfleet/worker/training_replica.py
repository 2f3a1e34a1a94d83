"""``TrainingReplica``: what the training loop needs of a replica, so that it can drive either kind.

``TrainingSession``, its hooks and the ``Checkpointer`` use exactly these members; ``Replica``
(one device) and ``tensorfleet.parallel.TowerReplica`` (K towers, one push per worker) both
implement them. On a ``TowerReplica``, the ps side (``client``, ``placement``, ``optimizer``,
``mode``, ...) lives on tower 0 only: the other towers raise ``AttributeError`` for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

    from tensorfleet.cluster.placement import Placement
    from tensorfleet.cluster.spec import TaskSpec
    from tensorfleet.protocol.specs import Mode, OptimizerSpec, SyncOptions
    from tensorfleet.protocol.state import ShardState
    from tensorfleet.worker.client import PsClient
    from tensorfleet.worker.dense import DenseAllReduce, DenseState


def ended_cleanly(exc_type: type[BaseException] | None) -> bool:
    """Whether a training block left with ``exc_type`` (None: no exception) ended cleanly, so that the
    replica says Done: running out of data (StopIteration) did; any other exception is a failure, and a
    failed worker says nothing (its restart takes its place)."""
    return exc_type is None or issubclass(exc_type, StopIteration)


@runtime_checkable
class TrainingReplica(Protocol):
    """A worker's model bound to the ps, as the training loop drives it (see ``Replica`` for each member)."""

    # --- every worker (every tower) ---------------------------------------------------------------

    @property
    def task(self) -> TaskSpec: ...

    @property
    def is_chief(self) -> bool: ...

    @property
    def module(self) -> nn.Module: ...

    @property
    def global_step(self) -> int: ...

    @property
    def dropped_gradients(self) -> int: ...

    def start(self, *, restore: Sequence[ShardState] | None = None) -> TrainingReplica: ...

    def recover(self, *, restore: Sequence[ShardState] | None, timeout_s: float) -> None: ...

    def finish(self, *, done: bool = True) -> None: ...

    def pull(self) -> int: ...

    def push(self) -> int: ...

    def load_averages(self) -> int: ...

    def report(self, *, loss: float | None = None, examples: int = 0, target_step: int | None = None,
               metrics: Mapping[str, float] | None = None) -> None: ...

    # --- the ps side (a TowerReplica's tower 0 only) ----------------------------------------------

    @property
    def client(self) -> PsClient: ...

    @property
    def placement(self) -> Placement: ...

    @property
    def num_ps(self) -> int: ...

    @property
    def optimizer(self) -> OptimizerSpec: ...

    @property
    def mode(self) -> Mode: ...

    @property
    def sync(self) -> SyncOptions | None: ...

    @property
    def average_decay(self) -> float | None: ...

    @property
    def prefetch(self) -> bool: ...

    def settle(self) -> int: ...

    # hybrid mode (dense="allreduce"): the dense half the workers keep, which the chief checkpoints and restores
    @property
    def dense_names(self) -> frozenset[str]: ...

    @property
    def dense(self) -> DenseAllReduce | None: ...

    def dense_state(self) -> DenseState: ...

    def restore_dense(self, values: Mapping[str, torch.Tensor], slots: Mapping[str, Mapping[str, torch.Tensor]],
                      updates: int, averages: Mapping[str, torch.Tensor] | None = None) -> None: ...
