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
from tensorfleet.protocol.status import PsStatus
from tensorfleet.wire import auth, rpc
from tensorfleet.worker.status import PROCESS_STATUS

log = logging.getLogger(__name__)

DONE_POLL_S = 1.0  # how often a worker waiting for work asks ps 0 whether the coordinator has finished
CLOSURE_END_WAIT_S = 30.0  # at the end, how long a closure still running may take before the server stops
COORDINATOR_REPLICA = 0  # the coordinator is the cluster's chief: replica 0 (``ClusterSpec.replicas``)


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
            session = self.context.session
            try:
                if request.began_at_step is not None and session is not None:
                    session.skip_pushed_steps(request.began_at_step)  # run again: what was pushed is skipped
                result = remote.run_in(self.context, function, args)
            except Exception as exc:  # noqa: BLE001 - the function's own error: the coordinator's to raise
                log.warning("%s: %s raised %s: %s", self.task.name, request.function, type(exc).__name__, exc)
                return RunReply(error=traceback.format_exc(), error_type=type(exc).__name__,
                                trained=self._trained_since(steps_before)).to_meta(), {}
            finally:
                if session is not None:
                    session.end_skipping()
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

    def serve(self, poll_s: float = DONE_POLL_S) -> None:
        """Serve until the coordinator says Done, or until ps 0 says the coordinator has said Done to it (the job
        is over: a worker restarted after the coordinator's shutdown gets no Done of its own); then stop serving
        once the closure running, if any, has ended (``CLOSURE_END_WAIT_S`` at most)."""
        while not self.finished.wait(poll_s):
            if self._coordinator_finished():
                log.info("%s: the coordinator has finished the job (ps 0 says it said Done): this worker ends",
                         self.task.name)
                break
        if self._one_at_a_time.acquire(timeout=CLOSURE_END_WAIT_S):
            self._one_at_a_time.release()
        self.server.stop(grace=1.0).wait()

    def _coordinator_finished(self) -> bool:
        """Whether the coordinator (the cluster's chief, replica 0) has told ps 0 it is done: it does so when its
        session ends cleanly, after its last closure and its Done to the workers."""
        session = self.context.session
        if session is None:
            return False
        try:
            status = PsStatus.from_meta(session.replica.client.channels[0].call("Status", timeout=DONE_POLL_S)[0])
        except TensorfleetError:
            return False  # ps 0 restarting, or gone: the coordinator's own Done, or a later poll, decides
        return COORDINATOR_REPLICA in (status.done_replicas or [])
