"""tensorfleet: train PyTorch models with parameter servers and workers, the classic distributed TensorFlow way.

The public API is what ``__all__`` lists; everything else is internal.  Names load on
first use (PEP 562), so ``import tensorfleet`` costs nothing until a name is touched:
the command line (``tensorfleet ckpt ls``, ``tensorfleet --help``) never pays for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("DeviceSpec", "device", "device_name"), "tensorfleet.cluster.device"),
    **dict.fromkeys(("GreedyByBytes", "RoundRobin", "RowPartitioner"), "tensorfleet.cluster.placement"),
    **dict.fromkeys(("ClusterSpec", "TaskSpec", "from_tf_config"), "tensorfleet.cluster.spec"),
    **dict.fromkeys(("add_cluster_flags", "cluster_from_flags"), "tensorfleet.cluster.flags"),
    **dict.fromkeys(("Coordinator", "RemoteError", "RemoteValue", "RemoteValues"),
                    "tensorfleet.coordinator.coordinator"),
    **dict.fromkeys(("remote", "worker_context"), "tensorfleet.coordinator.remote"),
    "join_fleet": "tensorfleet.coordinator.outside",
    **dict.fromkeys(("PlacedModule", "RpcGroup", "distributed_optimizer", "place_module", "placeable", "run_placed"),
                    "tensorfleet.coordinator.placement"),
    "TensorfleetError": "tensorfleet.errors",
    **dict.fromkeys(("run_coordinated", "run_task"), "tensorfleet.launch.task"),
    **dict.fromkeys(("TowerOptions", "TowerReplica", "Towers", "run_towers"), "tensorfleet.parallel"),
    **dict.fromkeys(("ExponentialDecay", "OptimizerSpec", "SyncOptions", "RowInitializer", "TableSpec"),
                    "tensorfleet.protocol.specs"),
    "Server": "tensorfleet.ps.server",
    **dict.fromkeys(("Checkpointer", "load_into_module", "load_tables"), "tensorfleet.train.checkpoint"),
    **dict.fromkeys(("CheckpointSaverHook", "Hook", "LoggingHook", "NanLossHook", "StepResult", "StopAtStepHook"),
                    "tensorfleet.train.hooks"),
    "TrainingSession": "tensorfleet.train.session",
    "SummaryHook": "tensorfleet.train.summary",
    "WireOptions": "tensorfleet.wire.rpc",
    **dict.fromkeys(("add_training_flags", "training_options"), "tensorfleet.worker.flags"),
    "Replica": "tensorfleet.worker.replica",
    "report_metrics": "tensorfleet.worker.status",
    "EmbeddingTable": "tensorfleet.worker.embedding",
    "ReplicaOptions": "tensorfleet.worker.options",
    "TrainingReplica": "tensorfleet.worker.training_replica",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorfleet' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from tensorfleet.cluster.device import DeviceSpec, device, device_name
    from tensorfleet.cluster.placement import GreedyByBytes, RoundRobin, RowPartitioner
    from tensorfleet.cluster.flags import add_cluster_flags, cluster_from_flags
    from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, from_tf_config
    from tensorfleet.coordinator.coordinator import Coordinator, RemoteError, RemoteValue, RemoteValues
    from tensorfleet.coordinator.outside import join_fleet
    from tensorfleet.coordinator.placement import (PlacedModule, RpcGroup, distributed_optimizer, place_module,
                                                   placeable, run_placed)
    from tensorfleet.coordinator.remote import remote, worker_context
    from tensorfleet.errors import TensorfleetError
    from tensorfleet.launch.task import run_coordinated, run_task
    from tensorfleet.parallel import TowerOptions, TowerReplica, Towers, run_towers
    from tensorfleet.protocol.specs import ExponentialDecay, OptimizerSpec, RowInitializer, SyncOptions, TableSpec
    from tensorfleet.ps.server import Server
    from tensorfleet.train.checkpoint import Checkpointer, load_into_module, load_tables
    from tensorfleet.train.hooks import (CheckpointSaverHook, Hook, LoggingHook, NanLossHook, StepResult,
                                         StopAtStepHook)
    from tensorfleet.train.session import TrainingSession
    from tensorfleet.train.summary import SummaryHook
    from tensorfleet.wire.rpc import WireOptions
    from tensorfleet.worker.flags import add_training_flags, training_options
    from tensorfleet.worker.options import ReplicaOptions
    from tensorfleet.worker.training_replica import TrainingReplica
    from tensorfleet.worker.embedding import EmbeddingTable
    from tensorfleet.worker.replica import Replica
