"""Synchronous aggregation on one ps shard: N-of-M, stale drop, backup workers. Plain torch, no RPC.

The protocol, ps side (compare ``tf.train.SyncReplicasOptimizer``):

1. The shard has a step ``k`` = the number of aggregations it has applied.
2. A worker pulls the parameters of step ``k`` and pushes its gradient tagged
   with ``k`` (the step of the parameters it was computed from).
3. A gradient tagged ``k`` is accumulated (a running mean, in place).  A gradient tagged
   ``< k`` is *stale*: dropped and counted.  A tag ``> k`` cannot come from a
   parameter this shard ever served and is refused as invalid.  A second
   gradient from the same replica for the same step is dropped as a duplicate.
4. When ``replicas_to_aggregate`` gradients of step ``k`` are in, their *mean*
   is applied once and the step becomes ``k + 1``.  With more replicas than
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

from dataclasses import dataclass
from enum import Enum
from typing import Mapping

import torch

from tensorfleet.errors import InvalidArgumentError

ON_MISSING = ("error", "continue")


@dataclass(frozen=True)
class SyncOptions:
    """How a synchronous job aggregates.

    Args:
        replicas_to_aggregate: gradients averaged per step (default: every replica).
        total_num_replicas: replicas in the job; defaults to, and must equal, the training tasks of the
            cluster. More than ``replicas_to_aggregate`` makes the extra ones backups.
        timeout_s: how long a push waits for the other replicas of its step.
        on_missing: ``"error"`` (name the missing replicas and fail) or ``"continue"``
            (apply what arrived) when ``timeout_s`` runs out.
    """

    replicas_to_aggregate: int | None = None
    total_num_replicas: int | None = None
    timeout_s: float = 300.0
    on_missing: str = "error"

    def resolve(self, num_replicas: int) -> "SyncOptions":
        """Fill the defaults from the cluster and check the numbers fit it."""
        total = self.total_num_replicas if self.total_num_replicas is not None else num_replicas
        aggregate = self.replicas_to_aggregate if self.replicas_to_aggregate is not None else total
        resolved = SyncOptions(aggregate, total, self.timeout_s, self.on_missing)
        resolved.check()
        if total != num_replicas:
            raise InvalidArgumentError(
                f"total_num_replicas={total} but the cluster has {num_replicas} training task(s): every worker "
                "pushes one gradient per step, so backups are the cluster's workers beyond replicas_to_aggregate")
        return resolved

    def check(self) -> None:
        r, n = self.replicas_to_aggregate, self.total_num_replicas
        if not isinstance(r, int) or not isinstance(n, int) or not 1 <= r <= n:
            raise InvalidArgumentError(f"need 1 <= replicas_to_aggregate ({r}) <= total_num_replicas ({n}): "
                                       "a step could never gather more gradients than there are replicas")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise InvalidArgumentError(f"sync timeout_s={t!r:.50} must be a positive number of seconds")
        if self.on_missing not in ON_MISSING:
            raise InvalidArgumentError(f"on_missing={self.on_missing!r}: choose one of {ON_MISSING}")

    def to_meta(self) -> dict:
        return {"replicas_to_aggregate": self.replicas_to_aggregate, "total_num_replicas": self.total_num_replicas,
                "timeout_s": self.timeout_s, "on_missing": self.on_missing}

    @classmethod
    def from_meta(cls, meta: object) -> "SyncOptions":
        if not isinstance(meta, dict):
            raise InvalidArgumentError(f"sync options must be an object, got {meta!r:.100}")
        try:
            options = cls(**meta)
        except TypeError as exc:
            raise InvalidArgumentError(f"bad sync options {meta!r:.200}: {exc}") from None
        options.check()
        return options


class Offer(Enum):
    ACCEPTED = "accepted"    # counted toward the current step; wait for the step to complete
    COMPLETE = "complete"    # this gradient completed the step: apply ``mean()`` now
    STALE = "stale"          # tagged with an older step: dropped
    DUPLICATE = "duplicate"  # this replica already gave a gradient for this step: dropped
    ABANDONED = "abandoned"  # the step can no longer complete (the other replicas finished): not applied
    RETRIED = "retried"      # the same push again (its reply was lost): its first copy counted, this one not


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

    def offer(self, replica: int, step: int, gradients: Mapping[str, torch.Tensor]) -> Offer:
        """Take one replica's gradients tagged with ``step``; say what became of them."""
        self.check_step(step)
        if step < self.step:
            self.dropped_stale += 1
            return Offer.STALE
        if replica in self._contributors:
            self.dropped_duplicate += 1
            return Offer.DUPLICATE
        self._contributors.append(replica)
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
        return Offer.COMPLETE if count >= self.options.replicas_to_aggregate else Offer.ACCEPTED

    def _reuse(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self._means.get(name)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty_like(like)
        return buffer

    def take_mean(self) -> dict[str, torch.Tensor]:
        """The mean of the gradients gathered for this step; resets and advances to the next step.

        The mean lives in the accumulator's buffers: apply it before the next ``offer``.
        """
        if not self._contributors:
            raise InvalidArgumentError(f"step {self.step} has no gradient to apply")
        mean = dict(self._means)
        self._contributors = []
        self.step += 1
        return mean
