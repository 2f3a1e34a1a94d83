"""What a training task tells anyone who asks: its step, loss, throughput and state.

Every task answers the ``Status`` RPC; a ps from its store, a worker from the
``TaskStatus`` of its process (``PROCESS_STATUS``), which the ``Replica`` and the
training loop keep current at the cost of a few attribute writes per step, as a
``WorkerStatus`` (``tensorfleet.protocol.status``).  The
launcher's progress line, the dashboard and ``/metrics`` all read it over the
wire: nothing scrapes logs.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from tensorfleet.cluster.environment import STATUS_DIR_ENV
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, bind_address
from tensorfleet.errors import TensorfleetError
from tensorfleet.protocol.status import WorkerStatus
from tensorfleet.wire import rpc

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class TaskStatus:
    """The training progress of this process: written by the training loop, read by the Status RPC.

    Plain attribute writes (atomic in CPython): a reader may see a step's fields from two
    neighbouring steps, never a torn value.
    """

    def __init__(self) -> None:
        self.task: str | None = None
        self.role = "worker"
        self.state = "starting"  # starting -> training -> done (or failed: training raised)
        self.started_unix = time.time()
        self.local_step = 0
        self.global_step = 0
        self.dropped_gradients = 0
        self.loss: float | None = None
        self.examples = 0
        self.target_step: int | None = None
        self.last_step_unix: float | None = None
        self.unique_ids: int | None = None  # embedding tables: unique ids in the last push (None: no tables)

    def begin(self, task: TaskSpec, *, is_chief: bool) -> None:
        self.task, self.role, self.state = task.name, "chief" if is_chief else "worker", "training"

    def pushed(self, global_step: int, dropped_gradients: int) -> None:
        self.local_step += 1
        self.global_step, self.dropped_gradients = global_step, dropped_gradients
        self.last_step_unix = time.time()

    def report(self, *, loss: float | None = None, examples: int = 0, target_step: int | None = None) -> None:
        if loss is not None:
            self.loss = loss
        self.examples += examples
        if target_step is not None:
            self.target_step = target_step

    def finished(self, *, failed: bool = False) -> None:
        self.state = "failed" if failed else "done"

    def as_status(self) -> WorkerStatus:
        """The Status reply, typed: the protocol's ``WorkerStatus``, which the launcher's monitor reads back."""
        now = time.time()
        return WorkerStatus(task=self.task, role=self.role, state=self.state, pid=os.getpid(),
                            uptime_s=now - self.started_unix, local_step=self.local_step,
                            global_step=self.global_step, dropped_gradients=self.dropped_gradients, loss=self.loss,
                            examples=self.examples, target_step=self.target_step, unique_ids=self.unique_ids,
                            last_step_age_s=None if self.last_step_unix is None else now - self.last_step_unix)

    def as_meta(self) -> dict[str, Any]:
        """The Status reply as it travels (and as the final-status file holds it)."""
        return self.as_status().to_meta()


PROCESS_STATUS = TaskStatus()


def final_status_path(directory: str | Path, task: TaskSpec) -> Path:
    return Path(directory) / f"{task.job_name}-{task.index}.status.json"


def write_final_status(task: TaskSpec, meta: dict[str, Any]) -> None:
    """Leave the last Status in ``$TENSORFLEET_STATUS_DIR`` (set by the launcher) as the task exits.

    A task stops answering the moment it is done, so the launcher's last poll can be up
    to a second old; this file gives its summary and dashboard the final step.
    """
    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory:
        return
    path = final_status_path(directory, task)
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta), encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        log.warning("%s: could not write its final status to %s: %s", task.name, path, exc)


def serve_status(cluster: ClusterSpec, task: TaskSpec, status: TaskStatus = PROCESS_STATUS) -> grpc.Server | None:
    """Answer ``Status`` on the task's own address, as every task of a classic cluster runs a server.

    Returns the server, or None when the address cannot be bound: training goes on without
    a status endpoint (and says so), since nothing in the step depends on it.
    """
    status.task = task.name
    status.role = "chief" if cluster.is_chief(task) else "worker"

    def handle(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        return status.as_meta(), {}

    address = bind_address(cluster.task_address(task.job_name, task.index))
    try:
        server, _ = rpc.start_server(address, {"Status": handle}, task=task.name, max_workers=2)
    except TensorfleetError as exc:
        log.warning("%s: no status endpoint (%s); the launcher and dashboard will show it as starting",
                    task.name, exc)
        return None
    return server
