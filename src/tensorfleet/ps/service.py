"""The ps's RPC adapter: wire messages in, typed requests (``tensorfleet.protocol``) to the store, replies out.

Init, Snapshot, Status, Done and Resize are gRPC methods (the control plane); Pull, Push,
Lookup, Fence and Snapshot travel on the data plane (``tensorfleet.wire.dataplane``), whose port Status tells.
What each request and reply holds is the contract's (``tensorfleet.protocol.messages``):
this module only decodes requests, hands them to the store and encodes its answers.

Membership: the job's replicas are ``0 .. num_workers-1``, from the cluster at start
(``TF_CONFIG``) and then from the launcher's Resize, as it scales an asynchronous job:
grown before new workers start, shrunk once removed workers have exited (having said
Done).  A shrink forgets the Done of the ids it removes, so an id that comes back is a
new worker; the ps finishes when every replica of the current membership has said Done.

A push or a lookup is one call of the store (``VariableStore.push_arriving``, ``lookup_arriving``), which checks
its head before the body is read and then takes it as one transaction.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.messages import (DoneReply, DoneRequest, FenceRequest, InitReply, InitRequest, LookupRequest,
                                           PullRequest, PushRequest, RendezvousReply, RendezvousRequest, ResizeReply,
                                           ResizeRequest, SnapshotReply, SnapshotRequest, StepReply)
from tensorfleet.protocol.state import ShardState
from tensorfleet.protocol.status import PsStatus
from tensorfleet.ps.rendezvous import KeyValues
from tensorfleet.ps.store import VariableStore
from tensorfleet.wire import auth
from tensorfleet.wire.dataplane import Method, Reply, Request
from tensorfleet.wire.rpc import Handler, Message

log = logging.getLogger(__name__)


class PsService:
    """Handlers for one ps shard. ``finished`` (the store's) is set once every worker has said Done."""

    def __init__(self, store: VariableStore, *, data_port: int = 0) -> None:
        self.store = store
        self.finished = store.finished  # the job's replicas and their Done are the store's, kept once
        self.data_port = data_port  # set by the server once the data plane listens
        self._started_unix = time.time()
        self.gate = auth.Gate(None)  # the server's, which counts calls refused for want of the token
        self.meeting = KeyValues()  # where a collective's workers meet (hybrid mode; served by ps 0)

    def handlers(self) -> dict[str, Handler]:
        """The control plane's gRPC methods."""
        return {"Init": self.init, "Snapshot": self.snapshot, "Status": self.status, "Done": self.done,
                "Resize": self.resize, "Rendezvous": self.rendezvous}

    def data_methods(self) -> dict[str, Method]:
        """The data plane's methods: the calls of every training step."""
        return {"Pull": self.pull, "Push": self.push, "Lookup": self.lookup, "Snapshot": self.snapshot_data,
                "Fence": self.fence}

    def init(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        init = InitRequest.from_meta(meta)
        restore = None
        if init.restore is not None:  # tensors are a flattened ShardState from a checkpoint
            global_step, applied_updates = init.restore
            restore = ShardState.unflatten(tensors, global_step=global_step, applied_updates=applied_updates)
            tensors = restore.values
        created = self.store.initialize(tensors, init.optimizer, init.sync, init.average_decay, restore,
                                        force=init.force, nonfinite=init.nonfinite, tables=init.tables, cut=init.cut)
        spec, sync = init.optimizer, init.sync
        if created:
            for table in init.tables:
                rows = len(restore.tables[table.name].ids) if restore and table.name in restore.tables else 0
                log.info("%s: embedding table %r: dim %d, %s, %s %s, %d row(s) here", self.store.task, table.name,
                         table.dim, f"{table.num_rows} rows" if table.num_rows else "any int64 id (growing)",
                         table.optimizer.name, dict(table.optimizer.options), rows)
            log.info("%s: initialized %d variable(s)%s, optimizer %s %s, %s", self.store.task, len(tensors),
                     f" from a checkpoint ({restore.applied_updates} updates)" if restore else "",
                     spec.name, dict(spec.options), f"sync {sync.to_meta()}" if sync else "async")
        else:
            log.info("%s: already initialized; kept the current values (not overwritten)", self.store.task)
        return InitReply(created).to_meta(), {}

    def pull(self, request: Request) -> Reply:
        if request.entries:
            raise InvalidArgumentError("a Pull carries no tensors")
        pull = PullRequest.from_meta(request.meta)
        epoch = self.store.epoch  # before the values: a restore in between costs a refused push, never a wrong one
        values, step, release = self.store.read_live(averages=pull.averages)
        return _reply_with_values(StepReply(step, epoch).to_meta(), values, release, pull.wire_dtype)

    def lookup(self, request: Request) -> Reply:
        lookup = LookupRequest.from_meta(request.meta)
        rows, step = self.store.lookup_arriving(_entries(request), request.receive)
        if lookup.wire_dtype is not None:
            rows = {name: value.to(lookup.wire_dtype) for name, value in rows.items()}
        return Reply(StepReply(step).to_meta(), rows)

    def push(self, request: Request) -> Reply:
        push = PushRequest.from_meta(request.meta)
        result = self.store.push_arriving(push, _entries(request), lambda: (request.receive(), request.body))
        if result.values is None:
            return Reply(result.reply.to_meta())
        return _reply_with_values(result.reply.to_meta(), result.values, result.release, push.wire_dtype)

    def snapshot(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        """The shard's state, whole or (``since``: an update number) a delta; the reply says which it is."""
        ask = SnapshotRequest.from_meta(meta)
        state = self.store.snapshot(ask.since, ask.page, ask.pages, cut=ask.cut, token=ask.token)
        return SnapshotReply.of(state).to_meta(), state.flatten()

    def fence(self, request: Request) -> Reply:
        """Start a consistent cut (``VariableStore.fence``): hold pushes; answer each worker's latest applied and
        the shard's step. ``hold_s``: how long at most (a restore's fence lasts while the shards take it)."""
        if request.entries:
            raise InvalidArgumentError("a Fence carries no tensors")
        fence = FenceRequest.from_meta(request.meta)
        if fence.release:  # the chief's save failed elsewhere: no cut will come for this fence
            self.store.release_fence()
            return Reply({})
        return Reply(self.store.fence(fence.hold_s).to_meta())

    def snapshot_data(self, request: Request) -> Reply:
        """Snapshot on the data plane: the same request and reply as the gRPC method, the rows at TCP speed
        (a delta's tens of MB cross gRPC at a fraction of it, and the chief waits for them)."""
        if request.entries:
            raise InvalidArgumentError("a Snapshot carries no tensors")
        meta, tensors = self.snapshot(request.meta, {})
        return Reply(meta, tensors)

    def status(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        roll = self.store.roll()
        store = self.store.status()
        fields = {f.name: getattr(store, f.name) for f in dataclasses.fields(store)}  # shallow: TableCounts kept
        status = PsStatus(**fields, task=self.store.task, pid=os.getpid(),
                          uptime_s=time.time() - self._started_unix,
                          state="done" if roll.finished else "running", done_replicas=roll.done,
                          workers_done=len(roll.done), num_workers=roll.count, sync=self.store.sync_options,
                          data_port=self.data_port, auth_refused=self.gate.refused)
        return status.to_meta(), {}

    def done(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        roll = self.store.replica_done(DoneRequest.from_meta(meta).replica)
        return DoneReply(len(roll.done), roll.count).to_meta(), {}

    def rendezvous(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        """One operation on the collective's meeting place (``ps/rendezvous.py``; workers call ps 0's)."""
        ask = RendezvousRequest.from_meta(meta)
        value = tensors.get("value")
        if set(tensors) - {"value"} or (ask.op == "set") != (value is not None) \
                or value is not None and (value.dtype != torch.uint8 or value.dim() != 1):
            raise InvalidArgumentError("a Rendezvous set carries one 1-D uint8 tensor 'value'; other operations none")
        if ask.op == "set":
            self.meeting.set(ask.key, value.numpy().tobytes())
            return RendezvousReply(True).to_meta(), {}
        if ask.op == "get":
            found = self.meeting.get(ask.key, ask.wait_s)
            if found is None:
                return RendezvousReply(False).to_meta(), {}
            return RendezvousReply(True).to_meta(), {"value": torch.tensor(list(found), dtype=torch.uint8)
                                                     if len(found) < 64 else torch.frombuffer(bytearray(found),
                                                                                              dtype=torch.uint8)}
        if ask.op == "add":
            return RendezvousReply(True, self.meeting.add(ask.key, ask.amount)).to_meta(), {}
        if ask.op == "check":
            return RendezvousReply(self.meeting.check(ask.keys)).to_meta(), {}
        return RendezvousReply(self.meeting.delete(ask.key)).to_meta(), {}

    def resize(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        """The launcher scaled the job: its replicas are now ``0 .. replicas-1`` (see the module docstring).

        A finished ps stays finished (its workers are gone; the launcher is ending the job): it answers
        ``finished`` and changes nothing.  A sync ps refuses: its steps aggregate a fixed number of replicas.
        """
        if tensors:
            raise InvalidArgumentError("a Resize carries no tensors")
        roll = self.store.set_replicas(ResizeRequest.from_meta(meta).replicas)
        return ResizeReply(roll.count, len(roll.done), roll.finished).to_meta(), {}

    @property
    def num_workers(self) -> int:
        return self.store.roll().count


def _entries(request: Request) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A request's tensors as its head announces them, before the body is read."""
    return {e.name: (e.dtype, e.shape) for e in request.entries}


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
