"""Synchronous aggregation on one ps shard: N-of-M, stale drop, backup workers. Plain torch, no RPC.

The protocol, ps side (compare ``tf.train.SyncReplicasOptimizer``):

1. The shard has a step ``k`` = the number of aggregations it has applied.
2. A worker pulls the parameters of step ``k`` and pushes its gradient tagged
   with ``k`` (the step of the parameters it was computed from).  Rows of embedding tables
   come as (ids, row gradients) per table; each replica's ids are its own.
3. A gradient tagged ``k`` is accumulated (a running mean, in place).  A gradient tagged
   ``< k`` is *stale*: dropped and counted.  A tag ``> k`` cannot come from a
   parameter this shard ever served and is refused as invalid.  A second
   gradient from the same replica for the same step is dropped as a duplicate.
4. When ``replicas_to_aggregate`` gradients of step ``k`` are in, their *mean*
   is applied once (for a table: each row's gradients summed over the union of the
   replicas' ids and divided by the number of replicas, a replica that did not touch
   a row counting as zero, which is the gradient of the replicas' batches taken as one)
   and the step becomes ``k + 1``.  With more replicas than
   that (backup workers) the slowest ones arrive stale and nobody waits for them.

Replica side: push, then wait until the shard's step passes the tag (the push
RPC itself blocks), then pull.  So every replica starts step ``k + 1`` from the
parameters of aggregation ``k``; there are no tokens to hand out, lose, or
leave behind when a worker dies.

Differences from TF, on purpose: a step that can no longer gather enough
gradients because the other replicas have finished (said Done) releases its
waiters at once as *abandoned*, instead of leaving a straggler stuck at the end
of the job.  And the wait is bounded.  When it runs out with
gradients still missing, ``on_missing="error"`` (default) fails the waiting
pushes with an error that names the replicas that did not push (the step's
gradients are kept, so a restarted worker can still complete it), and
``on_missing="continue"`` applies the mean of the gradients that did arrive.
"""

from __future__ import annotations

from typing import Mapping

import torch

Rows = dict[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (unique ids, one row gradient per id)

from tensorfleet.errors import InvalidArgumentError
from tensorfleet.protocol.specs import SyncOptions
from tensorfleet.protocol.messages import Outcome

class SyncAccumulator:
    """Averages the gradients of the current step until enough have arrived. Not thread-safe: the store locks.

    It keeps a running mean (the k-th gradient moves it by ``(g - mean) / k``, one ``lerp_``),
    so the mean is ready the moment the step completes: no summing pass and dividing pass.
    """

    def __init__(self, options: SyncOptions) -> None:
        options.check()
        self.options = options
        self.step = 0
        self.dropped_stale = 0
        self.dropped_duplicate = 0
        self._means: dict[str, torch.Tensor] = {}  # running means; buffers kept from step to step
        self._rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # this step's rows, per table
        self._contributors: list[int] = []

    @property
    def contributors(self) -> tuple[int, ...]:
        """Replicas whose gradient is in the current step's sum, in arrival order."""
        return tuple(self._contributors)

    def check_step(self, step: int) -> None:
        """Refuse a gradient tagged with a step this shard has not reached."""
        if step > self.step:
            raise InvalidArgumentError(f"gradient tagged with step {step}, but this shard is at step {self.step}: "
                                       "a step from the future (the worker must tag the step it pulled)")

    def offer(self, replica: int, step: int, gradients: Mapping[str, torch.Tensor], rows: Rows | None = None
              ) -> Outcome:
        """Take one replica's gradients (and rows of tables) tagged with ``step``; say what became of them.

        The rows are copied (they may be views of a receive buffer); they are summed when the step completes.
        """
        self.check_step(step)
        if step < self.step:
            self.dropped_stale += 1
            return Outcome.STALE
        if replica in self._contributors:
            self.dropped_duplicate += 1
            return Outcome.DUPLICATE
        self._contributors.append(replica)
        for table, (ids, grads) in (rows or {}).items():
            self._rows.setdefault(table, []).append((ids.clone(), grads.clone()))
        count = len(self._contributors)
        if count == 1:
            self._means = {name: self._reuse(name, grad).copy_(grad) for name, grad in gradients.items()}
        else:
            for name, grad in gradients.items():
                mean = self._means.get(name)
                if mean is None:  # cannot happen for a sync push (it carries every variable); stay correct anyway
                    self._means[name] = grad.detach() / count
                else:
                    mean.lerp_(grad, 1.0 / count)
        return Outcome.COMPLETE if count >= self.options.replicas_to_aggregate else Outcome.ACCEPTED

    def _reuse(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self._means.get(name)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty_like(like)
        return buffer

    def take_mean(self) -> tuple[dict[str, torch.Tensor], Rows]:
        """The mean of the gradients gathered for this step, and of the tables' rows; resets and advances to
        the next step.

        The dense mean lives in the accumulator's buffers: apply it before the next ``offer``.
        """
        if not self._contributors:
            raise InvalidArgumentError(f"step {self.step} has no gradient to apply")
        mean = dict(self._means)
        rows = {table: _row_mean(parts, len(self._contributors)) for table, parts in self._rows.items()}
        self._contributors, self._rows = [], {}
        self.step += 1
        return mean, rows


def _row_mean(parts: list[tuple[torch.Tensor, torch.Tensor]], replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each id's row gradients summed over the replicas that sent it, divided by ``replicas``."""
    if len(parts) == 1:
        ids, grads = parts[0]
        return ids, grads / replicas
    ids = torch.cat([p[0] for p in parts])
    unique, inverse = torch.unique(ids, return_inverse=True)
    total = torch.zeros((unique.numel(), parts[0][1].shape[1]), dtype=parts[0][1].dtype)
    total.index_add_(0, inverse, torch.cat([p[1] for p in parts]))
    return unique, total.div_(replicas)
