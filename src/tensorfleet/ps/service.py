"""The ps's RPC adapter: translates wire messages to VariableStore calls, nothing more.

Request and reply fields (the ``meta`` of a codec message):

==========  ===========================================  ==========================================
method      request                                      reply
==========  ===========================================  ==========================================
Init        optimizer: {name, options}; tensors: values  initialized: bool (False: already was)
Pull        names: [str] or absent (all)                 global_step; tensors: values
Push        advance_step: bool; tensors: gradients       global_step
Status      -                                            initialized, global_step, counters
Done        replica: int                                 workers_done, num_workers
==========  ===========================================  ==========================================
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import torch

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.ps.apply import OptimizerSpec
from tensorfleet.ps.store import VariableStore
from tensorfleet.wire.rpc import Handler, Message

log = logging.getLogger(__name__)


class PsService:
    """Handlers for one ps shard. ``finished`` is set once every worker has said Done."""

    def __init__(self, store: VariableStore, *, num_workers: int) -> None:
        self.store = store
        self.num_workers = num_workers
        self.finished = threading.Event()
        self._done: set[int] = set()
        self._done_lock = threading.Lock()

    def handlers(self) -> dict[str, Handler]:
        return {"Init": self.init, "Pull": self.pull, "Push": self.push, "Status": self.status, "Done": self.done}

    def init(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        spec = OptimizerSpec.from_meta(meta.get("optimizer"))
        created = self.store.initialize(tensors, spec)
        if created:
            log.info("%s: initialized %d variable(s), optimizer %s %s",
                     self.store.task, len(tensors), spec.name, dict(spec.options))
        else:
            log.info("%s: already initialized; kept the current values (not overwritten)", self.store.task)
        return {"initialized": created}, {}

    def pull(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        names = meta.get("names")
        if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
            raise InvalidArgumentError(f"Pull 'names' must be a list of strings, got {names!r:.100}")
        values, step = self.store.read(names)
        return {"global_step": step}, values

    def push(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        advance = meta.get("advance_step", False)
        if not isinstance(advance, bool):
            raise InvalidArgumentError(f"Push 'advance_step' must be a bool, got {advance!r:.50}")
        return {"global_step": self.store.apply(tensors, advance_step=advance)}, {}

    def status(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        reply = dataclasses.asdict(self.store.status())
        reply.update(task=self.store.task, workers_done=len(self._done), num_workers=self.num_workers)
        return reply, {}

    def done(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
        replica = meta.get("replica")
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < self.num_workers:
            raise InvalidArgumentError(f"Done 'replica' must be an int in 0..{self.num_workers - 1}, got {replica!r}")
        with self._done_lock:
            self._done.add(replica)
            count = len(self._done)
        if count >= self.num_workers:
            self.finished.set()
        return {"workers_done": count, "num_workers": self.num_workers}, {}
