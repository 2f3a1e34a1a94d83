"""The variables of one ps shard, their optimizer, the step and the counters.

All mutation happens under one lock, and every request is validated before
anything is written, so a bad request leaves the shard bit-identical.

Readers of the live tensors (``read_live``: a pull's reply goes to the socket
straight from the variables, without a copy) hold a *shared* hold; an update
waits until no reader holds one, and readers arriving while an update waits
queue behind it, so a stream of pulls cannot starve the updates.

Steps: in async mode only ps task 0 counts the global step (the worker tags
exactly one shard's part of each push with ``advance_step``).  In sync mode
every shard counts its own aggregations (they advance together, since every
replica pushes to every shard), and ps task 0's count is the global step.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

from tensorfleet.errors import DeadlineExceededError, InvalidArgumentError, NotInitializedError, StaleIncarnationError
from tensorfleet.ps.aggregate import Offer, SyncAccumulator, SyncOptions
from tensorfleet.ps.apply import Applier, MovingAverage, OptimizerSpec, check_gradients, check_layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardState:
    """Everything a shard holds, for checkpoints: values, optimizer slots, averages and counters."""

    values: dict[str, torch.Tensor]
    slots: dict[str, dict[str, torch.Tensor]]
    averages: dict[str, torch.Tensor] | None
    global_step: int
    applied_updates: int

    def flatten(self) -> dict[str, torch.Tensor]:
        """One flat name per tensor: ``value/<var>``, ``slot/<slot>/<var>``, ``average/<var>``."""
        flat = {f"value/{name}": value for name, value in self.values.items()}
        for name, entries in self.slots.items():
            flat.update({f"slot/{slot}/{name}": value for slot, value in entries.items()})
        for name, value in (self.averages or {}).items():
            flat[f"average/{name}"] = value
        return flat

    @classmethod
    def unflatten(cls, flat: Mapping[str, torch.Tensor], *, global_step: int, applied_updates: int) -> "ShardState":
        values: dict[str, torch.Tensor] = {}
        slots: dict[str, dict[str, torch.Tensor]] = {}
        averages: dict[str, torch.Tensor] = {}
        for key, tensor in flat.items():
            kind, _, rest = key.partition("/")
            if kind == "value" and rest:
                values[rest] = tensor
            elif kind == "average" and rest:
                averages[rest] = tensor
            elif kind == "slot" and "/" in rest:
                slot, _, name = rest.partition("/")
                slots.setdefault(name, {})[slot] = tensor
            else:
                raise InvalidArgumentError(f"state tensor {key!r} is not value/<var>, slot/<slot>/<var> "
                                           "or average/<var>")
        stray = (set(slots) | set(averages)) - set(values)
        if stray:
            raise InvalidArgumentError(f"slots or averages for variable(s) with no value: {sorted(stray)[:5]}")
        return cls(values, slots, averages or None, global_step, applied_updates)


NONFINITE_POLICIES = ("reject", "apply")


@dataclass(frozen=True)
class StoreStatus:
    initialized: bool
    mode: str | None
    global_step: int
    applied_updates: int
    dropped_stale: int
    dropped_duplicate: int
    num_variables: int
    num_bytes: int
    initial_updates: int  # applied_updates at the last initialization (a restored checkpoint's count)
    accepted_pushes: int  # pushes taken for the first time since then (applied, or offered to a sync step)
    retried_pushes: int  # pushes received again after a lost reply: recognized, not applied twice
    rejected_nonfinite: int  # pushes refused for NaN/Inf gradients


@dataclass(frozen=True)
class Origin:
    """Who sent a push: the worker (replica id), the incarnation of its process, and the push's sequence
    number on this shard.  A later incarnation replaces an earlier one; a sequence number seen before
    is a retry."""

    worker: int
    incarnation: int
    seq: int


class VariableStore:
    """Variables of one shard. Thread-safe; every method is one atomic step (a sync push waits inside).

    Args:
        task: this shard's task name, for messages.
        replica_names: task names of the training replicas by replica id, to name missing ones.
    """

    def __init__(self, *, task: str, replica_names: Sequence[str] = ()) -> None:
        self.task = task
        self.replica_names = list(replica_names)
        self._cond = threading.Condition()
        self._variables: dict[str, torch.Tensor] = {}
        self._applier: Applier | None = None
        self._sync: SyncAccumulator | None = None
        self._average: MovingAverage | None = None
        self._global_step = 0
        self._applied_updates = 0
        self._done: set[int] = set()
        self._readers = 0  # replies being sent from the live tensors (read_live)
        self._updates_waiting = 0
        self._generation = 0  # bumped by a forced restore: releases sync waits of the old timeline
        self.nonfinite = "reject"  # NaN/Inf gradients: "reject" the push or "apply" it (set by Init)
        self._origins: dict[int, Origin] = {}  # worker -> its latest push (exactly-once bookkeeping)
        self._initial_updates = 0
        self._accepted_pushes = 0
        self._retried_pushes = 0
        self._rejected_nonfinite = 0

    def initialize(self, values: Mapping[str, torch.Tensor], spec: OptimizerSpec,
                   sync: SyncOptions | None = None, average_decay: float | None = None,
                   restore: ShardState | None = None, force: bool = False, nonfinite: str = "reject") -> bool:
        """Take initial values (copied), the optimizer, the mode and the moving-average decay (None: no averages);
        with ``restore``, also the optimizer slots, averages and counters of a checkpoint.

        Return False, changing nothing, if already initialized: a second initialization
        (a restarted chief) must never overwrite trained values.  ``force`` is the one
        exception: after a ps was lost, the chief rolls *every* shard back to the same
        checkpoint so that they agree again.  ``nonfinite`` is what happens to a push with
        NaN/Inf gradients: "reject" it (counted and logged), or "apply" it.
        """
        if nonfinite not in NONFINITE_POLICIES:
            raise InvalidArgumentError(f"nonfinite={nonfinite!r}: use one of {NONFINITE_POLICIES}", task=self.task)
        owned = {name: value.detach().clone() for name, value in values.items()}
        applier = Applier(spec, owned)  # validates everything before anything is stored
        accumulator = SyncAccumulator(sync) if sync is not None else None
        average = MovingAverage(average_decay, owned) if average_decay is not None else None
        if restore is not None:
            applier.load_slots(restore.slots)
            if average is not None and restore.averages is not None:
                for name, shadow in average.shadows.items():
                    saved = restore.averages.get(name, shadow)
                    if saved.shape != shadow.shape or saved.dtype != shadow.dtype:
                        raise InvalidArgumentError(
                            f"restored average of {name!r} is {saved.dtype} {tuple(saved.shape)}, but the variable "
                            f"is {shadow.dtype} {tuple(shadow.shape)}", task=self.task)
                    shadow.copy_(saved)
            if accumulator is not None:
                accumulator.step = restore.global_step
        with self._cond:
            if self._applier is not None and not force:
                return False
            self._variables, self._applier, self._sync, self._average = owned, applier, accumulator, average
            self.nonfinite = nonfinite
            self._global_step = restore.global_step if restore is not None else 0
            self._applied_updates = restore.applied_updates if restore is not None else 0
            self._initial_updates, self._accepted_pushes = self._applied_updates, 0
            self._generation += 1
            self._cond.notify_all()
            return True

    def snapshot(self) -> ShardState:
        """A consistent copy of the whole shard, taken under the lock."""
        with self._cond:
            self._require_initialized()
            return ShardState(
                values={name: value.clone() for name, value in self._variables.items()},
                slots=self._applier.slots(),
                averages={n: v.clone() for n, v in self._average.shadows.items()} if self._average else None,
                global_step=self._global_step, applied_updates=self._applied_updates)

    @property
    def sync_options(self) -> SyncOptions | None:
        return self._sync.options if self._sync is not None else None

    def read(self, names: Iterable[str] | None = None, *,
             averages: bool = False) -> tuple[dict[str, torch.Tensor], int]:
        """A consistent snapshot (copies) of some or all variables (or their moving averages), with the step."""
        with self._cond:
            self._require_initialized()
            if averages and self._average is None:
                raise InvalidArgumentError("this job keeps no moving averages: the chief sets average_decay",
                                           task=self.task)
            source = self._average.shadows if averages else self._variables
            wanted = list(source) if names is None else list(names)
            unknown = [n for n in wanted if n not in source]
            if unknown:
                raise InvalidArgumentError(f"unknown variable(s) {unknown[:5]}: this shard holds "
                                           f"{', '.join(sorted(source)[:8])}", task=self.task)
            return {name: source[name].clone() for name in wanted}, self._global_step

    def read_live(self, *, averages: bool = False) -> tuple[dict[str, torch.Tensor], int, Callable[[], None]]:
        """The live tensors of every variable (or average), the step, and ``release`` to call when done.

        No copy: until ``release()`` the caller holds a shared hold and no update can run, so the
        tensors stay consistent while they are sent.  Call ``release()`` exactly once, soon.
        """
        with self._cond:
            while self._updates_waiting:
                self._cond.wait()
            self._require_initialized()
            if averages and self._average is None:
                raise InvalidArgumentError("this job keeps no moving averages: the chief sets average_decay",
                                           task=self.task)
            source = dict(self._average.shadows if averages else self._variables)
            self._readers += 1
            return source, self._global_step, self._release_reader

    def _release_reader(self) -> None:
        with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    def _exclusive(self) -> None:
        """Wait (holding the condition's lock between waits) until no reader holds the live tensors."""
        if not self._readers:
            return
        self._updates_waiting += 1
        try:
            while self._readers:
                self._cond.wait()
        finally:
            self._updates_waiting -= 1
            self._cond.notify_all()

    def check_push(self, layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], *,
                   wire_dtype: torch.dtype | None = None) -> None:
        """Refuse, before its bytes are read, a push naming unknown variables or wrong shapes or dtypes."""
        with self._cond:
            self._require_initialized()
            check_layout(self._variables, layout, task=self.task, wire_dtype=wire_dtype)

    def upcast(self, gradients: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gradients that travelled in a narrower dtype, in their variables' dtypes (fp32 accumulation)."""
        with self._cond:
            dtypes = {name: self._variables[name].dtype for name in gradients if name in self._variables}
        return {name: grad if dtypes.get(name, grad.dtype) == grad.dtype else grad.to(dtypes[name])
                for name, grad in gradients.items()}

    def apply(self, gradients: Mapping[str, torch.Tensor], *, advance_step: bool,
              origin: Origin | None = None) -> tuple[int, str]:
        """Async mode: apply one update now; advance the global step if asked.

        Returns:
            (the step after it, "applied"), or "retried" for a push already applied (``origin`` seen before).
        Raises:
            StaleIncarnationError: ``origin`` is an incarnation of its worker older than one already seen.
        """
        with self._cond:
            self._exclusive()  # first: from here on the lock is never released until the update is done
            self._require_initialized()
            if self._sync is not None:
                raise InvalidArgumentError("this ps runs in sync mode: a push must carry the replica and the step "
                                           "of the parameters it was computed from", task=self.task)
            check_gradients(self._variables, gradients, task=self.task)
            if not self._admit(origin):
                return self._global_step, "retried"
            if gradients:
                self._apply(gradients)
            if advance_step:
                self._global_step += 1
            return self._global_step, "applied"

    def _admit(self, origin: Origin | None) -> bool:
        """Exactly once: True for a push seen for the first time, False for a retry of one already taken.

        Called under the lock, after the push was validated and before it changes anything.
        """
        if origin is None:  # a caller that does not number its pushes (tests, tools): no dedup
            self._accepted_pushes += 1
            return True
        known = self._origins.get(origin.worker)
        if known is not None and origin.incarnation < known.incarnation:
            raise StaleIncarnationError(
                f"push from an old incarnation of {self._replica_name(origin.worker)} ({origin.incarnation}; "
                f"the current one is {known.incarnation}): that process was replaced, so its pushes are refused",
                task=self.task)
        if known is not None and origin.incarnation == known.incarnation and origin.seq <= known.seq:
            self._retried_pushes += 1
            log.warning("%s: push %d from %s received again (its reply was lost); not applied twice",
                        self.task, origin.seq, self._replica_name(origin.worker))
            return False
        self._origins[origin.worker] = origin
        self._accepted_pushes += 1
        return True

    def reject_nonfinite(self, names: Sequence[str], origin: Origin | None) -> None:
        """Count and log a push refused for NaN/Inf gradients in ``names``."""
        with self._cond:
            self._rejected_nonfinite += 1
            count = self._rejected_nonfinite
        sender = self._replica_name(origin.worker) if origin is not None else "a worker"
        log.warning("%s: rejected a push from %s with NaN/Inf in %s (%d rejected so far); nothing applied. "
                    "Lower the learning rate or check the data; Replica(nonfinite_gradients='apply') applies them",
                    self.task, sender, ", ".join(sorted(names)[:5]), count)

    def push_sync(self, replica: int, step: int, gradients: Mapping[str, torch.Tensor],
                  origin: Origin | None = None) -> tuple[int, Offer]:
        """Sync mode: offer one replica's gradients for ``step`` and wait until that step is aggregated.

        Returns:
            (this shard's step afterwards, what became of the gradients).
        Raises:
            DeadlineExceededError: the step did not gather enough gradients in time (``on_missing="error"``);
                the message names the replicas that did not push.
        """
        with self._cond:
            self._exclusive()  # offer and aggregation happen in one hold of the lock
            self._require_initialized()
            sync = self._sync
            if sync is None:
                raise InvalidArgumentError("this ps runs in async mode: push without a step", task=self.task)
            if not 0 <= replica < sync.options.total_num_replicas:
                raise InvalidArgumentError(f"replica {replica} is not in 0..{sync.options.total_num_replicas - 1}",
                                           task=self.task)
            check_gradients(self._variables, gradients, task=self.task)
            missing = set(self._variables) - set(gradients)
            if missing:
                raise InvalidArgumentError(f"a sync push must carry every variable of the shard; missing "
                                           f"{sorted(missing)[:5]}", task=self.task)
            sync.check_step(step)  # every refusal comes before _admit: a refused push is not "accepted"
            if not self._admit(origin):  # a retry: the first copy was offered; wait for its step like it
                if sync.step <= step:
                    self._wait_for_step(step)
                return self._global_step, Offer.RETRIED
            offer = sync.offer(replica, step, gradients)
            if offer is Offer.COMPLETE:
                self._aggregate()
            elif offer is Offer.ACCEPTED:
                offer = self._wait_for_step(step)
            if offer in (Offer.STALE, Offer.DUPLICATE, Offer.ABANDONED):
                self._log_drop(offer, replica, step)
            return self._global_step, offer

    def replica_done(self, replica: int) -> int:
        """Record that a replica finished; return how many have. Wakes sync waits that can no longer complete."""
        with self._cond:
            self._done.add(replica)
            self._cond.notify_all()
            return len(self._done)

    def _cannot_complete(self) -> bool:
        """True when the replicas still training cannot bring the current step to replicas_to_aggregate."""
        sync = self._sync
        contributed = set(sync.contributors)
        could_still_push = set(range(sync.options.total_num_replicas)) - self._done - contributed
        return len(contributed) + len(could_still_push) < sync.options.replicas_to_aggregate

    def _aggregate(self) -> None:
        self._exclusive()  # a no-op after push_sync's; needed when a timeout aggregates what arrived
        self._apply(self._sync.take_mean())
        self._global_step += 1
        self._cond.notify_all()

    def _apply(self, gradients: Mapping[str, torch.Tensor]) -> None:
        """One update (async push, or a sync aggregation): optimizer, then the moving averages."""
        self._applier.apply(gradients, step=self._applied_updates)
        if self._average is not None:
            self._average.update(self._applied_updates)
        self._applied_updates += 1

    def _wait_for_step(self, step: int) -> Offer:
        options = self._sync.options
        deadline = time.monotonic() + options.timeout_s
        generation = self._generation
        while self._sync.step <= step:
            if self._generation != generation:  # the shard was restored from a checkpoint meanwhile
                return Offer.ABANDONED
            if self._cannot_complete():
                return Offer.ABANDONED
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._on_timeout(step)
                break
            self._cond.wait(remaining)
        return Offer.ACCEPTED

    def _on_timeout(self, step: int) -> None:
        sync = self._sync
        have = [self._replica_name(r) for r in sync.contributors]
        missing = [self._replica_name(r) for r in range(sync.options.total_num_replicas)
                   if r not in sync.contributors]
        summary = (f"step {step} gathered {len(have)} of {sync.options.replicas_to_aggregate} gradient(s) in "
                   f"{sync.options.timeout_s:g} s (from {', '.join(have)}); missing: {', '.join(missing)}")
        if sync.options.on_missing == "continue":
            log.warning("%s: %s; applying the %d that arrived (on_missing='continue')", self.task, summary, len(have))
            self._aggregate()
            return
        raise DeadlineExceededError(f"{summary}. Restart the missing worker(s), add backup workers "
                                    "(total_num_replicas > replicas_to_aggregate), or use on_missing='continue'",
                                    task=self.task, step=step)

    def _log_drop(self, offer: Offer, replica: int, step: int) -> None:
        if offer is Offer.ABANDONED:
            log.info("%s: step %d cannot complete: the other replicas have finished; released %s",
                     self.task, step, self._replica_name(replica))
            return
        count = self._sync.dropped_stale if offer is Offer.STALE else self._sync.dropped_duplicate
        if count <= 5 or count % 100 == 0:
            log.info("%s: dropped a %s gradient from %s (step %d, shard at step %d); %d %s dropped so far",
                     self.task, offer.value, self._replica_name(replica), step, self._sync.step, count, offer.value)

    def _replica_name(self, replica: int) -> str:
        return self.replica_names[replica] if replica < len(self.replica_names) else f"replica {replica}"

    def status(self) -> StoreStatus:
        with self._cond:
            sync = self._sync
            return StoreStatus(
                initialized=self._applier is not None,
                mode=None if self._applier is None else ("sync" if sync else "async"),
                global_step=self._global_step, applied_updates=self._applied_updates,
                dropped_stale=sync.dropped_stale if sync else 0,
                dropped_duplicate=sync.dropped_duplicate if sync else 0,
                num_variables=len(self._variables),
                num_bytes=sum(v.numel() * v.element_size() for v in self._variables.values()),
                initial_updates=self._initial_updates, accepted_pushes=self._accepted_pushes,
                retried_pushes=self._retried_pushes,
                rejected_nonfinite=self._rejected_nonfinite)

    def _require_initialized(self) -> None:
        if self._applier is None:
            raise NotInitializedError("variables are not initialized yet: waiting for the chief", task=self.task)
