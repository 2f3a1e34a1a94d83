"""Command-line flags for the training choices of a job, shared by every training script.

    --sync | --async                 how the ps applies gradients (classic `issync`; default async, or
                                     TENSORFLEET_MODE, which `tensorfleet launch --sync` sets)
    --replicas_to_aggregate R        sync: gradients averaged per step (default: every worker)
    --total_num_replicas N           sync: workers in the job; N > R makes backups (default: every worker)
    --sync_timeout_s S               sync: how long a step waits for missing workers before failing
    --placement round_robin|greedy   how variables are spread over the ps tasks
    --partitions P                   split variables of at least --partition_min_bytes into P row parts
    --log_device_placement           log where each variable lives
    --moving_average_decay D         keep an exponential moving average of the variables on the ps
                                     (0: none), for evaluation with Replica.load_averages()
    --overlap                        send each gradient as soon as backward produces it (one backward
                                     per push, no gradient changes between backward and push)
    --prefetch                       async: each push travels while the next step computes, on values
                                     one update older (hides the round trip)
    --wire_dtype float32|bfloat16|float16
                                     the dtype gradients and values travel in (the ps stays fp32)
    --nonfinite_gradients reject|apply
                                     what the ps does with NaN/Inf gradients (default: reject the push)
    --dense ps|allreduce             where the dense parameters live: on the ps (default), or replicated on
                                     the workers and averaged by gloo/NCCL (hybrid; tables stay on the ps;
                                     TENSORFLEET_DENSE)
    --towers K                       K towers on this machine: the batch split over K devices, their
                                     gradients averaged, one push per worker (TENSORFLEET_TOWERS; 1: none)
    --tower_device auto|gpu|cpu      the towers' devices: /gpu:k, or K processes on the CPU (auto: GPUs if any)
    --allow_soft_placement           a tower whose GPU is missing runs on the CPU (with a warning) instead
                                     of failing
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from tensorfleet.cluster.placement import STRATEGIES, RowPartitioner
from tensorfleet.protocol.specs import NONFINITE_POLICIES, SyncOptions
from tensorfleet.wire.codec import DTYPE_NAMES, NARROW_DTYPES
from tensorfleet.worker.options import DENSE_HOMES, ReplicaOptions

# --wire_dtype choices: float32 (tensors travel as they are) or one of the codec's narrow dtypes.
WIRE_DTYPES: dict[str, torch.dtype | None] = {"float32": None, **{DTYPE_NAMES[d]: d for d in NARROW_DTYPES}}


def add_training_flags(parser: argparse.ArgumentParser, *, default_mode: str = "async", towers: bool = False) -> None:
    """Add the training flags above to ``parser`` (and turn off its abbreviations, as ``add_cluster_flags`` does).

    Args:
        default_mode: the mode when neither --sync/--async nor TENSORFLEET_MODE says.
        towers: also add --towers and --tower_device. Only a script that trains with ``run_towers`` acts on
            them; any other script refuses --towers rather than ignore it.
    """
    parser.allow_abbrev = False
    group = parser.add_argument_group("training")
    mode = group.add_mutually_exclusive_group()
    mode.add_argument("--sync", dest="mode", action="store_const", const="sync",
                      help="synchronous: the ps averages one gradient per worker per step")
    mode.add_argument("--async", dest="mode", action="store_const", const="async",
                      help="asynchronous: the ps applies each gradient as it arrives")
    # tensorfleet launch --sync/--async tells every task through TENSORFLEET_MODE; a flag here still wins.
    parser.set_defaults(mode=os.environ.get("TENSORFLEET_MODE", default_mode))
    group.add_argument("--replicas_to_aggregate", type=int, default=None)
    group.add_argument("--total_num_replicas", type=int, default=None)
    group.add_argument("--sync_timeout_s", type=float, default=300.0)
    group.add_argument("--placement", choices=sorted(STRATEGIES), default="round_robin")
    group.add_argument("--partitions", type=int, default=1, help="row parts per large variable (1: no split)")
    group.add_argument("--partition_min_bytes", type=int, default=256 * 1024)
    group.add_argument("--log_device_placement", action="store_true", help="log where each variable lives")
    group.add_argument("--moving_average_decay", type=float, default=0.0,
                       help="keep a moving average of the variables on the ps with this decay (0: none)")
    group.add_argument("--wire_dtype", choices=sorted(WIRE_DTYPES), default="float32",
                       help="dtype of gradients and values on the wire; the ps keeps and updates fp32")
    group.add_argument("--overlap", action="store_true",
                       help="push each gradient as soon as backward produces it (needs one backward per push)")
    group.add_argument("--prefetch", action="store_true",
                       help="async: let each push travel while the next step computes (values one update older)")
    group.add_argument("--nonfinite_gradients", choices=NONFINITE_POLICIES, default="reject",
                       help="what the ps does with NaN/Inf gradients: reject the push (default) or apply it")
    group.add_argument("--dense", choices=DENSE_HOMES, default=os.environ.get("TENSORFLEET_DENSE", "ps"),
                       help="where the dense parameters live: on the ps, or replicated on the workers and averaged "
                            "by an all-reduce (hybrid; embedding tables stay on the ps)")
    devices = parser.add_argument_group("devices" + (" (towers: several devices of one machine)" if towers else ""))
    if towers:
        devices.add_argument("--towers", type=int, default=os.environ.get("TENSORFLEET_TOWERS", "1"),
                             help="split each batch over K local devices and average their gradients (1: no towers)")
        devices.add_argument("--tower_device", choices=("auto", "gpu", "cpu"), default="auto",
                             help="the towers' devices: /gpu:k, or K processes on the CPU (auto: GPUs if any)")
    devices.add_argument("--allow_soft_placement", action="store_true",
                         help="a device that is missing is replaced by the CPU (with a warning) instead of failing")


def training_options(args: argparse.Namespace, **explicit: Any) -> dict[str, Any]:
    """Keyword arguments for ``Replica`` (or ``TowerReplica``) from the flags above, composable with your own.

    Only the options a flag sets away from ``Replica``'s own default are in the dict, so
    ``Replica(..., average_decay=0.99, **training_options(args))`` works; should the flag set
    that option too (``--moving_average_decay 0.9``), Python refuses the call naming the
    keyword given twice.  To let your value win over any flag, pass it here instead:
    ``Replica(..., **training_options(args, average_decay=0.99))``.
    """
    options = {
        "mode": args.mode,
        "sync": SyncOptions(args.replicas_to_aggregate, args.total_num_replicas, args.sync_timeout_s),
        "placement": STRATEGIES[args.placement](),
        "partitioner": RowPartitioner(args.partitions, args.partition_min_bytes) if args.partitions > 1 else None,
        "log_placement": args.log_device_placement,
        "average_decay": args.moving_average_decay or None,
        "overlap": args.overlap,
        "prefetch": args.prefetch,
        "wire_dtype": WIRE_DTYPES[args.wire_dtype],
        "nonfinite_gradients": args.nonfinite_gradients,
        "dense": args.dense,
    }
    defaults = ReplicaOptions.defaults()  # Replica's (and TowerReplica's) defaults are the baseline
    defaults["sync"] = SyncOptions()  # Replica's None means these
    chosen = {name: value for name, value in options.items() if not _same(value, defaults[name])}
    if args.mode != "sync":
        chosen.pop("sync", None)
    return {**chosen, **explicit}


def _same(value: Any, default: Any) -> bool:
    """Equal, or instances of one stateless strategy class (``RoundRobin() == RoundRobin()``)."""
    if type(value) is type(default) and hasattr(value, "__dict__"):
        return vars(value) == vars(default)
    return value == default
