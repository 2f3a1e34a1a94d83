"""tensorfleet: train PyTorch models with parameter servers and workers, the classic distributed TensorFlow way.

The public API is what ``__all__`` lists; everything else is internal.
"""

from tensorfleet.cluster.device import DeviceSpec, device, device_name
from tensorfleet.cluster.placement import GreedyByBytes, RoundRobin, RowPartitioner
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, add_cluster_flags, cluster_from_flags, from_tf_config
from tensorfleet.errors import TensorfleetError
from tensorfleet.launch.task import run_task
from tensorfleet.parallel import TowerOptions, TowerReplica, Towers, run_towers
from tensorfleet.ps.aggregate import SyncOptions
from tensorfleet.ps.apply import ExponentialDecay, OptimizerSpec
from tensorfleet.ps.server import Server
from tensorfleet.train.checkpoint import Checkpointer, load_into_module
from tensorfleet.train.hooks import CheckpointSaverHook, Hook, LoggingHook, NanLossHook, StepResult, StopAtStepHook
from tensorfleet.train.session import TrainingSession
from tensorfleet.train.summary import SummaryHook
from tensorfleet.wire.rpc import WireOptions
from tensorfleet.worker.flags import add_training_flags, training_options
from tensorfleet.worker.replica import Replica

__version__ = "0.1.0"

__all__ = [
    "CheckpointSaverHook", "Checkpointer", "Hook", "LoggingHook", "NanLossHook", "StepResult", "StopAtStepHook",
    "SummaryHook", "TrainingSession", "load_into_module",
    "ClusterSpec", "TaskSpec", "add_cluster_flags", "cluster_from_flags", "from_tf_config",
    "ExponentialDecay", "GreedyByBytes", "OptimizerSpec", "Replica", "RoundRobin", "RowPartitioner", "Server",
    "SyncOptions", "TensorfleetError", "WireOptions", "add_training_flags", "run_task", "training_options",
    "DeviceSpec", "TowerOptions", "TowerReplica", "Towers", "device", "device_name", "run_towers",
]
