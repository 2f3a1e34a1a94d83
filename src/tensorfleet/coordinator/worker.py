"""A worker under a coordinator: it trains only when told, running the script's remote functions one request at a
time (``Run``), until the coordinator says ``Done``.

It answers ``Status`` on the same address, as every worker does, so the launcher and the dashboard see it. A
function that raises does not end the worker: its error, with the traceback, is the answer, and the next request
runs as usual.
"""

from __future__ import annotations

import logging
import threading
import traceback
from typing import Any

import torch

from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, bind_address
from tensorfleet.coordinator import remote
from tensorfleet.errors import InvalidArgumentError, TensorfleetError
from tensorfleet.protocol.closures import RunReply, RunRequest, Trained, pack, unpack
from tensorfleet.wire import auth, rpc
from tensorfleet.worker.status import PROCESS_STATUS

log = logging.getLogger(__name__)


class ClosureServer:
    """Runs ``Run`` requests in this process (one at a time: a worker is one replica) until ``Done``."""

    def __init__(self, cluster: ClusterSpec, task: TaskSpec, context: remote.WorkerContext) -> None:
        self.task, self.context = task, context
        self.finished = threading.Event()
        self._one_at_a_time = threading.Lock()
        PROCESS_STATUS.task = task.name
        PROCESS_STATUS.role = "worker"
        address = bind_address(cluster.task_address(task.job_name, task.index))
        options = rpc.WireOptions()
        PROCESS_STATUS.gate = auth.Gate(options.token, task.name)  # its refusals show in the Status (auth_refused)
        self.server, _ = rpc.start_server(address, {"Status": self._status, "Run": self._run, "Done": self._done},
                                          task=task.name, options=options, max_workers=4, gate=PROCESS_STATUS.gate)

    def _status(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        return PROCESS_STATUS.as_meta(), {}

    def _run(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        request = RunRequest.from_meta(meta)  # InvalidArgumentError: the caller's, answered as such
        function = remote.function_named(request.function)
        args = unpack(request.args, tensors, self.context.kept)
        if not isinstance(args, list):
            raise InvalidArgumentError("Run 'args' must be a list")
        with self._one_at_a_time:
            steps_before = self._local_step()
            try:
                result = remote.run_in(self.context, function, args)
            except Exception as exc:  # noqa: BLE001 - the function's own error: the coordinator's to raise
                log.warning("%s: %s raised %s: %s", self.task.name, request.function, type(exc).__name__, exc)
                return RunReply(error=traceback.format_exc(), error_type=type(exc).__name__,
                                trained=self._trained_since(steps_before)).to_meta(), {}
            trained = self._trained_since(steps_before)
        if request.keep_as:
            self.context.kept[request.keep_as] = result
            return RunReply().to_meta(), {}
        out: dict[str, torch.Tensor] = {}
        try:
            packed = pack(result, out, "result")
        except TensorfleetError as exc:
            return RunReply(error=f"{request.function} returned what cannot travel: {exc}",
                            error_type=type(exc).__name__, trained=trained).to_meta(), {}
        return RunReply(result=packed, trained=trained).to_meta(), out

    def _local_step(self) -> int:
        return self.context.session.local_step if self.context.session is not None else 0

    def _trained_since(self, steps_before: int) -> Trained:
        """The steps the session ran since ``steps_before`` (a closure's), for the coordinator's hooks."""
        steps = self._local_step() - steps_before
        last = self.context.session.last_result if steps else None
        if last is None:
            return Trained()
        return Trained(steps, last.global_step, last.loss, steps * (last.batch_size or 0))

    def _done(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> rpc.Message:
        self.finished.set()
        return {}, {}

    def serve(self) -> None:
        """Serve until the coordinator says Done; then stop serving."""
        self.finished.wait()
        self.server.stop(grace=1.0).wait()
