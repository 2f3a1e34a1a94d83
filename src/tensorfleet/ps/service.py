"""The ps's RPC adapter: translates wire messages to VariableStore calls, nothing more.

Init, Snapshot, Status and Done are gRPC methods (the control plane); Pull and Push
travel on the data plane (``tensorfleet.wire.dataplane``), whose port Status tells.
Request and reply fields (the ``meta`` of a message):

==========  ===========================================  ==========================================
method      request                                      reply
==========  ===========================================  ==========================================
Init        optimizer: {name, options, schedule};        initialized: bool (False: already was)
            nonfinite: "reject" (default) | "apply";
            sync: {..} or absent (async); average_decay:
            float or absent; restore: {global_step,
            applied_updates} or absent; tensors: values,
            or with restore a flattened ShardState
Pull        averages: bool (moving averages instead      step (this shard's); tensors: every
            of values)                                   variable's value (or average)
Push        async: advance_step: bool                    step (this shard's); outcome (applied;
            sync: replica: int, step: int (blocks until  sync: accepted, complete, stale, duplicate,
            the step is aggregated); values: bool (reply abandoned; retried: a push received again
            with the values); origin: [worker,           after a lost reply, not applied twice;
            incarnation, seq] (exactly once: a seq seen  rejected: NaN/Inf gradients); with values:
            again is not applied again, an older         the shard's values after the update (a push
            incarnation is refused); tensors: gradients  and the next pull in one round trip)
Snapshot    -                                            global_step, applied_updates; tensors: the
                                                         flattened ShardState (values, slots, averages)
Status      -                                            initialized, mode, sync, step, counters,
                                                         data_port, task, role ("ps"), pid, uptime_s,
                                                         auth_refused; state ("running", or "done" once
                                                         every worker said Done), done_replicas (the
                                                         replica ids that said Done), workers_done
Done        replica: int                                 workers_done, num_workers
==========  ===========================================  ==========================================
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from typing import Any

import torch

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.ps.aggregate import SyncOptions
from tensorfleet.ps.apply import OptimizerSpec
from tensorfleet.ps.store import NONFINITE_POLICIES, Origin, ShardState, VariableStore
from tensorfleet.wire import auth
from tensorfleet.wire.codec import DTYPE_NAMES, DTYPES, NARROW_DTYPES
from tensorfleet.wire.dataplane import Method, Reply, Request
from tensorfleet.wire.rpc import Handler, Message

log = logging.getLogger(__name__)


class PsService:
    """Handlers for one ps shard. ``finished`` is set once every worker has said Done."""

    def __init__(self, store: VariableStore, *, num_workers: int, data_port: int = 0) -> None:
        self.store = store
        self.data_port = data_port  # set by the server once the data plane listens
        self.num_workers = num_workers
        self.finished = threading.Event()
        self._done_replicas: set[int] = set()  # for Status: who is done, even after it stops answering
        self._done_lock = threading.Lock()
        self._started_unix = time.time()
        self.gate = auth.Gate(None)  # the server's, which counts calls refused for want of the token

    def handlers(self) -> dict[str, Handler]:
        """The control plane's gRPC methods."""
        return {"Init": self.init, "Snapshot": self.snapshot, "Status": self.status, "Done": self.done}

    def data_methods(self) -> dict[str, Method]:
        """The data plane's methods: the two calls of every training step."""
        return {"Pull": self.pull, "Push": self.push}

    def init(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        spec = OptimizerSpec.from_meta(meta.get("optimizer"))
        sync = SyncOptions.from_meta(meta["sync"]) if meta.get("sync") is not None else None
        decay = meta.get("average_decay")
        if decay is not None and (isinstance(decay, bool) or not isinstance(decay, (int, float))):
            raise InvalidArgumentError(f"Init 'average_decay' must be a number, got {decay!r:.50}")
        restore = None
        if meta.get("restore") is not None:  # tensors are a flattened ShardState from a checkpoint
            counters = meta["restore"]
            if not isinstance(counters, dict):
                raise InvalidArgumentError(f"Init 'restore' must be an object {{global_step, applied_updates}}, "
                                           f"got {counters!r:.50}")
            restore = ShardState.unflatten(tensors, global_step=_int_field(counters, "global_step", method="Init"),
                                           applied_updates=_int_field(counters, "applied_updates", method="Init"))
            tensors = restore.values
        force = meta.get("force", False)
        if not isinstance(force, bool) or (force and restore is None):
            raise InvalidArgumentError("Init 'force' must be a bool and needs 'restore': only a checkpoint "
                                       "may overwrite a live shard")
        nonfinite = meta.get("nonfinite", "reject")
        if nonfinite not in NONFINITE_POLICIES:
            raise InvalidArgumentError(f"Init 'nonfinite' must be one of {NONFINITE_POLICIES}, got {nonfinite!r:.50}")
        created = self.store.initialize(tensors, spec, sync, decay, restore, force=force, nonfinite=nonfinite)
        if created:
            log.info("%s: initialized %d variable(s)%s, optimizer %s %s, %s", self.store.task, len(tensors),
                     f" from a checkpoint at step {restore.global_step}" if restore else "",
                     spec.name, dict(spec.options), f"sync {sync.to_meta()}" if sync else "async")
        else:
            log.info("%s: already initialized; kept the current values (not overwritten)", self.store.task)
        return {"initialized": created}, {}

    def pull(self, request: Request) -> Reply:
        if request.entries:
            raise InvalidArgumentError("a Pull carries no tensors")
        averages = request.meta.get("averages", False)
        if not isinstance(averages, bool):
            raise InvalidArgumentError(f"Pull 'averages' must be a bool, got {averages!r:.50}")
        wire_dtype = _wire_dtype(request.meta)
        values, step, release = self.store.read_live(averages=averages)
        return _reply_with_values({"step": step}, values, release, wire_dtype)

    def push(self, request: Request) -> Reply:
        meta = request.meta
        with_values = meta.get("values", False)
        if not isinstance(with_values, bool):
            raise InvalidArgumentError(f"Push 'values' must be a bool, got {with_values!r:.50}")
        sync = "step" in meta
        if sync:
            replica, step = _int_field(meta, "replica", method="Push"), _int_field(meta, "step", method="Push")
        else:
            advance = meta.get("advance_step", False)
            if not isinstance(advance, bool):
                raise InvalidArgumentError(f"Push 'advance_step' must be a bool, got {advance!r:.50}")
        wire_dtype = _wire_dtype(meta)
        self.store.check_push({e.name: (e.dtype, e.shape) for e in request.entries},  # before reading the body
                              wire_dtype=wire_dtype)
        origin = _origin(meta)
        gradients = request.receive()
        if wire_dtype is not None:
            gradients = self.store.upcast(gradients)
        nonfinite = self.store.nonfinite == "reject" and nonfinite_names(gradients, body=request.body)
        if nonfinite:
            self.store.reject_nonfinite(nonfinite, origin)
            reply = {"step": self.store.status().global_step, "outcome": "rejected"}
        elif sync:
            new_step, offer = self.store.push_sync(replica, step, gradients, origin)
            reply = {"step": new_step, "outcome": offer.value}
        else:
            new_step, outcome = self.store.apply(gradients, advance_step=advance, origin=origin)
            reply = {"step": new_step, "outcome": outcome}
        if not with_values:
            return Reply(reply)
        values, reply["step"], release = self.store.read_live()  # the step the values belong to
        return _reply_with_values(reply, values, release, wire_dtype)

    def snapshot(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        state = self.store.snapshot()
        return {"global_step": state.global_step, "applied_updates": state.applied_updates}, state.flatten()

    def status(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        reply = dataclasses.asdict(self.store.status())
        sync = self.store.sync_options
        with self._done_lock:
            done = sorted(self._done_replicas)
        reply.update(task=self.store.task, role="ps", pid=os.getpid(), uptime_s=time.time() - self._started_unix,
                     state="done" if self.finished.is_set() else "running", done_replicas=done,
                     workers_done=len(done), num_workers=self.num_workers,
                     sync=sync.to_meta() if sync else None, data_port=self.data_port,
                     auth_refused=self.gate.refused)
        return reply, {}

    def done(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        replica = _int_field(meta, "replica", method="Done")
        if replica >= self.num_workers:
            raise InvalidArgumentError(f"Done 'replica' must be in 0..{self.num_workers - 1}, got {replica}")
        count = self.store.replica_done(replica)
        with self._done_lock:
            self._done_replicas.add(replica)
        if count >= self.num_workers:
            self.finished.set()
        return {"workers_done": count, "num_workers": self.num_workers}, {}


def _wire_dtype(meta: dict[str, Any]) -> torch.dtype | None:
    """The narrower dtype floating-point tensors travel in (``wire_dtype``), or None: their own."""
    name = meta.get("wire_dtype")
    if name is None:
        return None
    allowed = [DTYPE_NAMES[dtype] for dtype in NARROW_DTYPES]
    if name not in allowed:
        raise InvalidArgumentError(f"'wire_dtype' {name!r:.30} is not one of {allowed} (or absent)")
    return DTYPES[name]


def _reply_with_values(meta: dict[str, Any], values: dict[str, torch.Tensor], release: Any,
                       wire_dtype: torch.dtype | None) -> Reply:
    """Live values under the shared hold, or narrowed copies (the hold released at once: they are ours)."""
    if wire_dtype is None:
        return Reply(meta, values, release)
    try:
        narrowed = {name: value.to(wire_dtype) if value.is_floating_point() else value.clone()
                    for name, value in values.items()}
    finally:
        release()
    return Reply(meta, narrowed)


def _origin(meta: dict[str, Any]) -> Origin | None:
    """A push's ``origin``: [worker, incarnation, seq], non-negative integers; absent: not numbered."""
    value = meta.get("origin")
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 3
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value)):
        raise InvalidArgumentError(f"Push 'origin' must be [worker, incarnation, seq] (non-negative integers), "
                                   f"got {value!r:.80}")
    return Origin(*value)


def nonfinite_names(gradients: dict[str, torch.Tensor], *, body: torch.Tensor | None = None) -> list[str]:
    """Names of floating-point gradients holding NaN or Inf.

    One summing pass (no temporary the size of the gradients): over ``body``, all the gradients
    as one tensor, when the push arrived as one; else over each gradient.  A sum that is not
    finite is confirmed element-wise, since finite values can also overflow when summed.
    """
    if body is not None and body.is_floating_point():
        total = body.sum(dtype=torch.float32) if body.element_size() < 4 else body.sum()  # fp16 sums overflow
        if math.isfinite(float(total)):
            return []
    suspects = [name for name, grad in gradients.items()
                if grad.is_floating_point() and grad.numel() and not math.isfinite(float(grad.sum()))]
    return [name for name in suspects if not bool(torch.isfinite(gradients[name]).all())]


def _int_field(meta: dict[str, Any], name: str, *, method: str) -> int:
    value = meta.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{method} {name!r} must be a non-negative integer, got {value!r:.50}")
    return value
