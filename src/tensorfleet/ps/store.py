"""The variables of one ps shard, their optimizer, the global step and the counters.

All mutation happens under one lock, and every request is validated before the
lock is taken for writing, so a bad request leaves the shard bit-identical.

``global_step`` is only meaningful on ps task 0: the worker tags exactly one
shard's part of each push (task 0's) with ``advance_step``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from tensorfleet.errors import InvalidArgumentError, NotInitializedError
from tensorfleet.ps.apply import Applier, OptimizerSpec, check_gradients


@dataclass(frozen=True)
class StoreStatus:
    initialized: bool
    global_step: int
    applied_updates: int
    num_variables: int
    num_bytes: int


class VariableStore:
    """Variables of one shard. Thread-safe; every method is one atomic step."""

    def __init__(self, *, task: str) -> None:
        self.task = task
        self._lock = threading.Lock()
        self._variables: dict[str, torch.Tensor] = {}
        self._applier: Applier | None = None
        self._global_step = 0
        self._applied_updates = 0

    def initialize(self, values: Mapping[str, torch.Tensor], spec: OptimizerSpec) -> bool:
        """Take initial values (copied) and the optimizer. Return False, changing nothing, if already initialized.

        A second initialization (a restarted chief) must never overwrite trained values.
        """
        owned = {name: value.detach().clone() for name, value in values.items()}
        applier = Applier(spec, owned)  # validates the spec before anything is stored
        with self._lock:
            if self._applier is not None:
                return False
            self._variables, self._applier = owned, applier
            return True

    def read(self, names: Iterable[str] | None = None) -> tuple[dict[str, torch.Tensor], int]:
        """A consistent snapshot (copies) of some or all variables, with the global step."""
        with self._lock:
            self._require_initialized()
            wanted = list(self._variables) if names is None else list(names)
            unknown = [n for n in wanted if n not in self._variables]
            if unknown:
                raise InvalidArgumentError(f"unknown variable(s) {unknown[:5]}: this shard holds "
                                           f"{', '.join(sorted(self._variables)[:8])}", task=self.task)
            return {name: self._variables[name].clone() for name in wanted}, self._global_step

    def apply(self, gradients: Mapping[str, torch.Tensor], *, advance_step: bool) -> int:
        """Apply one update; advance the global step by one if asked. Return the global step after it."""
        with self._lock:
            self._require_initialized()
            check_gradients(self._variables, gradients, task=self.task)
            if gradients:
                self._applier.apply(gradients)
                self._applied_updates += 1
            if advance_step:
                self._global_step += 1
            return self._global_step

    def status(self) -> StoreStatus:
        with self._lock:
            return StoreStatus(
                initialized=self._applier is not None, global_step=self._global_step,
                applied_updates=self._applied_updates, num_variables=len(self._variables),
                num_bytes=sum(v.numel() * v.element_size() for v in self._variables.values()))

    def _require_initialized(self) -> None:
        if self._applier is None:
            raise NotInitializedError("variables are not initialized yet: waiting for the chief", task=self.task)
