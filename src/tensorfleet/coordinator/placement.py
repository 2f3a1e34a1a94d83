"""Placing a model's parts on other tasks' devices, as classic TensorFlow's ``with tf.device("/job:worker/task:1")``.

One program, the chief, holds the model; a submodule placed on ``/job:worker/task:K/device:CPU:0`` (or
``GPU:N``) lives in worker K's process, and its forward and backward cross processes as calls of the job's own
authenticated wire: each a gRPC call that proves the job's token, carrying a JSON head and raw tensors
(``tensorfleet.wire``). Nothing is pickled and no code crosses the wire::

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden = nn.Linear(784, 100)                                        # here, on the chief
            self.out = place_module("/job:worker/task:1/cpu:0", nn.Linear, 100, 10)  # in worker 1's process
        def forward(self, x):
            return self.out(torch.relu(self.hidden(x)))

    def drive(group: RpcGroup) -> None:          # runs on the chief only
        model = Net()
        optimizer = distributed_optimizer(torch.optim.Adam, model, lr=0.01)
        for images, labels in data:
            train_step(lambda: F.cross_entropy(model(images), labels), optimizer)

    sys.exit(run_placed(parse_args(), drive))    # every task: the chief drives, the workers serve

**Who takes part.** The cluster's training tasks, chief first (``ClusterSpec.replicas``): ``chief:0`` when the
cluster has a chief job (``tensorfleet launch --coordinator``), else ``worker:0``, then the workers. ps tasks
take no part (``run_placed`` lets them exit at once). Each worker serves on its own task address, nothing else
(``placegroup.py``); the chief calls them there.

**What a worker builds** (``placeable.py``): a module is built from a *name* the worker resolves itself: a
``torch.nn`` module class, or a constructor the script marked ``@tfl.placeable`` (every task runs the same
script), with JSON arguments only; an optimizer is a ``torch.optim`` class by name with JSON settings. Anything
else is refused with INVALID_ARGUMENT, on the chief before it sends, and on the worker.

**How a step crosses** (``bridge.py`` on the chief, ``hosted.py`` on a worker). ``PlacedModule.forward`` runs in
a ``torch.autograd.Function``: its forward sends the inputs (with a context id) and returns the outputs, its
backward sends the outputs' gradients and returns the inputs'. The worker keeps each context's inputs and outputs
while grad is on (at most 64 at once; a Step frees its module's), fills its parameters' ``.grad`` in the backward,
and steps its own optimizer (``distributed_optimizer``: the same class and settings as the chief's). Under
``torch.no_grad()`` nothing is kept. So ``train_step`` gives what one process would, bit for bit.

**Security.** Every call proves the job's token (``auth.Gate``; refusals counted in the worker's Status); without a
token, a cluster on non-loopback addresses is refused unless ``insecure=True`` / ``--insecure`` /
``TENSORFLEET_INSECURE=1``, as for every other task.

**Failures.** A chief whose ``drive`` fails on a configuration error (a device a task lacks, a constructor a
worker refuses, a wrong setting) exits 2 with the error as its last line, and the launcher does not start it
again: the same command would fail the same way. A chief that crashes (an exception, a signal) leaves its
workers serving: the chief renews a lease on each every 2 s, and a worker whose chief has not called for 15 s
says so and waits up to ``start_timeout_s`` (120 s) for a chief to join again (the launcher restarts it); a new
session replaces the last one's modules. A restarted chief places its modules again and resumes from the
checkpoint its ``drive`` wrote (``save_checkpoint`` / ``restore_checkpoint``: the model's values, placed parts
included, and the step), or trains from step 0 and says so. A worker that waits in vain exits 1 saying so. A
worker that dies takes its placed parts with it: the chief's next call fails (a recoverable error), and the chief
says so in one line and exits 1, to be started again with it.

**Progress.** ``train_step`` counts the chief's steps (``RpcGroup.global_step``; a restored checkpoint's step
counts from there) and its Status says them, as a worker's does: the launcher's progress line, dashboard and
summary show the job's real global step.

**Why it is not the default.** Every step moves the activations at the cut and their gradients, through one
program; between-graph replication moves each worker's parameters and gradients and nothing else, and scales
with the workers. ``benchmarks/remote_placement.py`` measures both.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from tensorfleet.cluster.device import DeviceSpec
from tensorfleet.cluster.flags import cluster_from_flags, insecure_from_flags
from tensorfleet.coordinator.bridge import PlacedModule, PlacedOptimizer
from tensorfleet.coordinator.placeable import placeable
from tensorfleet.coordinator.placegroup import (ALIVE_EVERY_S, LEASE_S, START_TIMEOUT_S, ChiefLeftError,
                                                PlacementGroup, RpcGroup, active_group, current_group)
from tensorfleet.errors import (ClusterSpecError, ConfigError, DataError, DeadlineExceededError,
                                InvalidArgumentError, TensorfleetError, UnavailableError, WireError)
from tensorfleet.train.atomic import write_atomically
from tensorfleet.train.manifest import check_checkpoint_directory
from tensorfleet.worker.status import PROCESS_STATUS, serve_status, write_final_status

__all__ = ["ALIVE_EVERY_S", "CHECKPOINT_FILE", "CONFIGURATION_ERRORS", "ChiefLeftError", "LEASE_S", "PlacedModule",
           "PlacedOptimizer", "PlacementGroup", "RpcGroup", "START_TIMEOUT_S", "current_group",
           "distributed_optimizer", "place_module", "placeable", "restore_checkpoint", "run_placed",
           "save_checkpoint", "train_step"]

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "placed.safetensors"
USAGE_EXIT = 2  # a configuration error: the launcher does not start the task again
# What a restart cannot fix: the same command fails the same way (a wire error is not one: the wire failed).
CONFIGURATION_ERRORS = (ClusterSpecError, ConfigError, InvalidArgumentError, DataError)


def place_module(device: str | DeviceSpec, module_fn: Callable[..., nn.Module], *args: Any,
                 allow_soft_placement: bool = False, **kwargs: Any) -> nn.Module:
    """Build ``module_fn(*args, **kwargs)`` on ``device``, e.g. ``"/job:worker/task:1/device:GPU:0"``.

    On another member's device the worker builds the module itself, by name, and it is returned as a
    ``PlacedModule`` to use like any submodule; a name without job and task (``"/cpu:0"``) or naming this task
    places it here, as TensorFlow does.

    Args:
        device: a classic device name (``tensorfleet.cluster.device``): CPU or GPU of a chief or worker task.
        module_fn: a ``torch.nn`` module class, or a constructor marked ``@tfl.placeable`` in the script.
        args, kwargs: JSON values (numbers, strings, booleans, None, lists and dicts of them).
        allow_soft_placement: a GPU the task lacks becomes its CPU (logged there) instead of an error.
    Raises:
        InvalidArgumentError: a name that does not parse, a task outside the group, a GPU the task lacks (the
            message lists the devices it has), a ``module_fn`` a worker would not build, or an argument that is
            not JSON.
    """
    return current_group().place_module(device, module_fn, *args, allow_soft_placement=allow_soft_placement,
                                        **kwargs)


def distributed_optimizer(optimizer_class: type[torch.optim.Optimizer], model: nn.Module,
                          **defaults: Any) -> PlacedOptimizer:
    """One ``optimizer_class`` per task over ``model``'s parameters, each updating the parameters it holds (the
    same rule as one optimizer for per-parameter rules such as SGD and Adam). ``optimizer_class`` is a
    ``torch.optim`` class (or one marked ``@tfl.placeable``), ``defaults`` JSON values."""
    return PlacedOptimizer(optimizer_class, model, **defaults)


def train_step(loss_fn: Callable[[], torch.Tensor], optimizer: PlacedOptimizer | torch.optim.Optimizer,
               ) -> torch.Tensor:
    """One step across processes: ``loss_fn()`` (the forward), its backward through every task, and
    ``optimizer.step()`` (which zeroes every gradient after it); returns the loss, detached.

    The same as writing::

        optimizer.zero_grad(); loss = loss_fn(); loss.backward(); optimizer.step()

    without the call that zeroes the placed parts' gradients (their step did).
    """
    if isinstance(optimizer, PlacedOptimizer):
        optimizer.zero_local_grad()
    else:
        optimizer.zero_grad()
    loss = loss_fn()
    loss.backward()
    optimizer.step()
    loss = loss.detach()
    group = active_group()
    if group is not None:
        group._stepped(float(loss))
    return loss


# --- checkpoints: what a restarted chief resumes from ------------------------------------------------------


def save_checkpoint(model: nn.Module, directory: str | Path, step: int) -> Path:
    """Write ``model``'s values (its placed parts' read from the tasks that hold them) and ``step`` to
    ``directory/placed.safetensors``, whole or not at all (safetensors: tensors and text, nothing pickled).

    Returns:
        the file's path.
    """
    path = Path(directory) / CHECKPOINT_FILE
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)  # only its owner writes it, whatever the umask
    state = {key: value.detach().contiguous() for key, value in model.state_dict().items()}
    write_atomically(path, safetensors_bytes(state, metadata={"global_step": str(step)}))
    return path


def restore_checkpoint(model: nn.Module, directory: str | Path) -> int | None:
    """Load the checkpoint of ``directory`` (``save_checkpoint``'s) into ``model``, its placed parts included,
    and start the group's step at its step.

    Returns:
        the checkpoint's step, or None when ``directory`` holds none.
    """
    path = Path(directory) / CHECKPOINT_FILE
    check_checkpoint_directory(path.parent)  # before reading: a directory others can write is refused
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as checkpoint:
        step = int((checkpoint.metadata() or {}).get("global_step", 0))
        model.load_state_dict({key: checkpoint.get_tensor(key) for key in checkpoint.keys()})
    group = active_group()
    if group is not None:
        group.set_progress(global_step=step)
    return step


# --- a task's entry point -----------------------------------------------------------------------------


def run_placed(args: argparse.Namespace, drive: Callable[[RpcGroup], None], *, intra_op_threads: int = 1,
               start_timeout_s: float = START_TIMEOUT_S) -> int:
    """Run this process's task of a program that places parts of its model on workers: the chief opens the
    group's session and calls ``drive(group)``; a worker serves until the chief is done; a ps exits (it takes no
    part). The cluster comes from the classic flags or TF_CONFIG (``add_cluster_flags``), so the same script runs
    by hand and under ``tensorfleet launch --coordinator`` (its chief drives).

    A worker whose chief stopped calling (it crashed, or failed) waits up to ``start_timeout_s`` for a chief to
    join again (see the module docstring, Failures).

    Returns:
        the exit code: 0; 2 for a wrong cluster or setting (a non-loopback cluster without a token or
        ``--insecure``), or a configuration error raised by ``drive`` (``CONFIGURATION_ERRORS``: a device a task
        lacks, say), the error the last line printed; 1 when a worker waited for its chief in vain.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cluster, task = cluster_from_flags(args)
        if task not in cluster.replicas:
            log.info("%s takes no part in placing modules: it exits", task.name)
            return 0
        group = RpcGroup(cluster, task, insecure=insecure_from_flags(args), start_timeout_s=start_timeout_s)
    except (ClusterSpecError, ConfigError) as exc:
        return _error(exc, USAGE_EXIT)
    torch.set_num_threads(intra_op_threads)
    PROCESS_STATUS.begin(task, is_chief=group.is_chief)
    code = _drive(group, drive) if group.is_chief else _serve(group)
    if code == 0:
        PROCESS_STATUS.finished()
        write_final_status(task, PROCESS_STATUS.as_meta())  # the launcher's summary reads the last step here
    return code


def _drive(group: RpcGroup, drive: Callable[[RpcGroup], None]) -> int:
    """The chief: its Status on its own address (the launcher and the dashboard ask), the session, ``drive``."""
    status_server = serve_status(group.cluster, group.task)
    try:
        with group:
            drive(group)
    except CONFIGURATION_ERRORS as exc:
        if isinstance(exc, WireError):
            raise
        PROCESS_STATUS.finished(failed=True)
        return _error(exc, USAGE_EXIT)
    except TensorfleetError as exc:
        if not exc.recoverable:
            raise
        PROCESS_STATUS.finished(failed=True)  # a worker lost or restarted: a new session must place it all again
        return _error(f"{exc} (exiting, to be started again: a restarted chief places its modules again and "
                      "resumes from its checkpoint)", 1)
    finally:
        if status_server is not None:
            status_server.stop(0).wait(5.0)
    return 0


def _serve(group: RpcGroup) -> int:
    """A worker: serve its chief's session until released, waiting (bounded) for a chief that left to return."""
    try:
        group.start()
        while True:
            try:
                group.serve()
                break
            except ChiefLeftError as exc:
                group.await_chief(exc)
    except (DeadlineExceededError, UnavailableError) as exc:
        return _error(exc, 1)  # no chief (or none came back), or the task's port taken: nothing to serve
    finally:
        group.close(graceful=False)
    return 0


def _error(exc: Exception | str, code: int) -> int:
    print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr, flush=True)
    return code
