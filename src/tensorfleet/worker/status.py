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
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import grpc

from tensorfleet.cluster.environment import STATUS_DIR_ENV
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, bind_address
from tensorfleet.errors import InvalidArgumentError, TensorfleetError
from tensorfleet.protocol.status import MAX_METRICS, WorkerStatus, check_metric_name
from tensorfleet.wire import auth, rpc

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
        self.metrics: dict[str, float] = {}  # what the script measured of its model (tfl.report_metrics)
        self.gate: auth.Gate | None = None  # the status server's, whose refusals the Status counts

    def begin(self, task: TaskSpec, *, is_chief: bool) -> None:
        self.task, self.role, self.state = task.name, "chief" if is_chief else "worker", "training"

    def pushed(self, global_step: int, dropped_gradients: int) -> None:
        self.local_step += 1
        self.global_step, self.dropped_gradients = global_step, dropped_gradients
        self.last_step_unix = time.time()

    def report(self, *, loss: float | None = None, examples: int = 0, target_step: int | None = None,
               metrics: Mapping[str, float] | None = None) -> None:
        if loss is not None:
            self.loss = loss
        self.examples += examples
        if target_step is not None:
            self.target_step = target_step
        if metrics:
            self.metrics = {**self.metrics, **checked_metrics(metrics, already=self.metrics)}

    def finished(self, *, failed: bool = False) -> None:
        self.state = "failed" if failed else "done"

    def as_status(self) -> WorkerStatus:
        """The Status reply, typed: the protocol's ``WorkerStatus``, which the launcher's monitor reads back."""
        now = time.time()
        return WorkerStatus(task=self.task, role=self.role, state=self.state, pid=os.getpid(),
                            uptime_s=now - self.started_unix, local_step=self.local_step,
                            global_step=self.global_step, dropped_gradients=self.dropped_gradients, loss=self.loss,
                            examples=self.examples, target_step=self.target_step, unique_ids=self.unique_ids,
                            last_step_age_s=None if self.last_step_unix is None else now - self.last_step_unix,
                            metrics=dict(self.metrics) or None,
                            auth_refused=None if self.gate is None else self.gate.refused)

    def as_meta(self) -> dict[str, Any]:
        """The Status reply as it travels (and as the final-status file holds it)."""
        return self.as_status().to_meta()


PROCESS_STATUS = TaskStatus()


def checked_metrics(metrics: Mapping[str, float], *, already: Mapping[str, float] = {}) -> dict[str, float]:
    """``metrics`` as a Status carries them: names checked, values finite floats, at most ``MAX_METRICS`` in all.

    Raises:
        InvalidArgumentError: a bad name, a value that is not a finite number, or too many metrics.
    """
    checked = {}
    for name, value in metrics.items():
        check_metric_name(name)
        number = float(value) if not isinstance(value, bool) and isinstance(value, (int, float)) else math.nan
        if not math.isfinite(number):
            raise InvalidArgumentError(f"metric {name!r} must be a finite number, got {value!r:.80}")
        checked[name] = number
    if len({*already, *checked}) > MAX_METRICS:
        raise InvalidArgumentError(f"a task reports at most {MAX_METRICS} metrics")
    return checked


def report_metrics(**metrics: float) -> None:
    """Report what this task measured of its model (``tfl.report_metrics(accuracy=0.977)``): its Status carries
    them to the launcher's summary, the dashboard, ``/metrics`` and the job service's pages, as it carries the
    loss. A name reported again replaces its value; call it at the end of training, or as often as you evaluate.

    Raises:
        InvalidArgumentError: a name that is not printable text of 1-64 characters without spaces, a value that
        is not a finite number (NaN, a string, a tensor of more than one element), or more than 32 metrics.
    """
    PROCESS_STATUS.report(metrics={name: _scalar(value) for name, value in metrics.items()})


def _scalar(value: Any) -> Any:
    """A one-element tensor or numpy number as a Python number; anything else as it is (checked after)."""
    try:
        return value.item() if hasattr(value, "item") else value
    except (ValueError, RuntimeError):  # more than one element: refused as not a number
        return value


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
    options = rpc.WireOptions()
    status.gate = auth.Gate(options.token, task.name)  # its refusals show in the Status (auth_refused)
    try:
        server, _ = rpc.start_server(address, {"Status": handle}, task=task.name, options=options, max_workers=2,
                                     gate=status.gate)
    except TensorfleetError as exc:
        log.warning("%s: no status endpoint (%s); the launcher and dashboard will show it as starting",
                    task.name, exc)
        return None
    return server
