"""What this machine offers a job's tasks: its cores and its GPUs."""

from __future__ import annotations

import os

from tensorfleet.errors import ConfigError

BUSY_POLL_US = 2000  # the polling budget of each data connection when every task has a core of its own


def usable_cores() -> int:
    """The cores this process (and so the tasks it starts) may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def busy_poll_for(num_tasks: int) -> int:
    """The polling budget of the data connections of a job of ``num_tasks`` tasks on this machine: only if
    every task has a core of its own, since polling keeps a core busy while it waits
    (see ``tensorfleet.wire.frame.Reader``)."""
    return BUSY_POLL_US if num_tasks <= usable_cores() else 0


def visible_gpus() -> int:
    """How many CUDA devices this machine offers (torch is imported only when GPUs are asked for)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_assignment(gpus_per_worker: int, num_workers: int, available: int) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` for each worker: disjoint blocks of ``gpus_per_worker`` devices."""
    needed = gpus_per_worker * num_workers
    if needed > available:
        raise ConfigError(f"--gpus-per-worker {gpus_per_worker} with {num_workers} worker(s) needs {needed} GPU(s); "
                          f"this machine has {available}. Use fewer workers or GPUs per worker, or 0 to train on CPU")
    return [",".join(str(gpus_per_worker * w + g) for g in range(gpus_per_worker)) for w in range(num_workers)]
