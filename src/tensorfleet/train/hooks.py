"""Hooks of the training session, as in ``tf.train.SessionRunHook``.

A hook sees the session at five moments: ``begin`` (before the fleet starts),
``after_create_session`` (the variables are initialized or restored),
``before_step`` / ``after_step`` (around each step, with its ``StepResult``), and
``end`` (a clean exit only).  A hook stops training with ``session.request_stop()``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from tensorfleet.errors import InvalidArgumentError, NotInitializedError, UnavailableError
from tensorfleet.train.checkpoint import Checkpointer

if TYPE_CHECKING:
    from tensorfleet.worker.replica import Replica

log = logging.getLogger(__name__)


class Session(Protocol):
    """What a hook sees of its session (``TrainingSession`` is one; the session imports the hooks, so they name
    it by this shape, not by its class)."""

    replica: "Replica"

    @property
    def global_step(self) -> int: ...

    def request_stop(self) -> None: ...

    def fetch_global_step(self) -> int: ...

    def fetch_dropped_stale_gradients(self) -> int: ...


@dataclass(frozen=True)
class StepResult:
    """What one ``run_step`` did."""

    loss: float
    global_step: int     # after the push
    local_step: int      # steps this worker has run in this session
    seconds: float       # wall time of the step (pull, compute, push)
    batch_size: int | None
    dropped: bool        # the ps dropped the gradient (stale, in sync mode)
    skipped: bool        # nothing was pushed (non-finite loss, NanLossHook(mode="skip"))


class Hook:
    """Base class: every method does nothing."""

    def begin(self, session: Session) -> None: ...

    def after_create_session(self, session: Session) -> None: ...

    def before_step(self, session: Session) -> None: ...

    def after_step(self, session: Session, result: StepResult) -> None: ...

    def end(self, session: Session) -> None: ...


class StepTimer:
    """Triggers every ``every_steps`` global steps and/or every ``every_secs`` seconds (whichever comes
    first when both are given), and first at once. As TF's SecondOrStepTimer: never twice for one step.
    """

    def __init__(self, *, every_steps: int | None = None, every_secs: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if every_steps is None and every_secs is None:
            raise InvalidArgumentError("give every_steps, every_secs, or both")
        if (every_steps is not None and every_steps < 1) or (every_secs is not None and every_secs <= 0):
            raise InvalidArgumentError(f"every_steps={every_steps}, every_secs={every_secs} must be positive")
        self.every_steps, self.every_secs, self._clock = every_steps, every_secs, clock
        self._last_step: int | None = None
        self._last_time = 0.0

    def should_trigger(self, step: int) -> bool:
        if self._last_step is None:
            return True
        if step == self._last_step:
            return False
        by_steps = self.every_steps is not None and step >= self._last_step + self.every_steps
        by_time = self.every_secs is not None and self._clock() >= self._last_time + self.every_secs
        return by_steps or by_time

    def mark(self, step: int) -> None:
        self._last_step, self._last_time = step, self._clock()

    @property
    def last_step(self) -> int | None:
        return self._last_step


class StopAtStepHook(Hook):
    """Stop at a global step: ``last_step``, or ``num_steps`` after the step the session started at.

    A worker stops once a push of its own brought back a step >= ``last_step``: one worker, and
    sync mode, end exactly there. Async workers decide on the step they last saw, as in classic
    TF, so with N of them the job can end past ``last_step``, by at most N - 1 steps without
    prefetch (the others' last pushes were in flight together); only the ps could refuse those.
    """

    def __init__(self, *, num_steps: int | None = None, last_step: int | None = None) -> None:
        if (num_steps is None) == (last_step is None):
            raise InvalidArgumentError("StopAtStepHook takes exactly one of num_steps and last_step")
        self.num_steps, self.last_step = num_steps, last_step

    def after_create_session(self, session: Session) -> None:
        if self.num_steps is not None and self.last_step is None:  # not recomputed after a recovery
            self.last_step = session.global_step + self.num_steps
        session.replica.report(target_step=self.last_step)
        if session.global_step >= self.last_step:
            session.request_stop()

    def after_step(self, session: Session, result: StepResult) -> None:
        step = result.global_step
        if step + 1 >= self.last_step and getattr(session.replica, "prefetch", False):
            # With prefetch this step's push is still travelling and ``step`` is the one before it: without
            # waiting for it, one more step would run past last_step. Only near the end, so the overlap stays.
            try:
                step = session.replica.settle()
            except (UnavailableError, NotInitializedError):
                return  # that push went down with its ps: the next step's pull recovers, then runs again
        if step >= self.last_step:
            session.request_stop()


class CheckpointSaverHook(Hook):
    """The chief saves a checkpoint when the session starts, every N steps and/or seconds, and at the end.

    Only the chief saves; on other workers the hook does nothing.
    """

    def __init__(self, directory: str | Path, *, save_steps: int | None = None, save_secs: float | None = None,
                 max_to_keep: int = 5, full_every: int = 1, background: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if save_steps is None and save_secs is None:
            save_secs = 600.0  # MonitoredTrainingSession's default
        self.checkpointer = Checkpointer(directory, max_to_keep=max_to_keep, full_every=full_every,
                                         background=background)
        self._timer = StepTimer(every_steps=save_steps, every_secs=save_secs, clock=clock)
        self.saved: list[Path] = []

    def after_create_session(self, session: Session) -> None:
        self._save(session, session.global_step)

    def after_step(self, session: Session, result: StepResult) -> None:
        if self._timer.should_trigger(result.global_step):
            self._save(session, result.global_step)

    def end(self, session: Session) -> None:
        if session.replica.is_chief:
            self._save(session, None)
            self.checkpointer.wait()  # the last checkpoint is on disk when the session ends

    def _save(self, session: Session, step: int | None) -> None:
        """Save unless this step was just saved. A ps that is down skips the save: the next step recovers."""
        if not session.replica.is_chief:
            return
        try:
            step = session.fetch_global_step() if step is None else step  # never touch the model
            if step == self._timer.last_step:
                return
            path = self.checkpointer.save(session.replica)
        except (UnavailableError, NotInitializedError) as exc:
            log.warning("checkpoint at global step %s skipped: %s", step, exc)
            return
        self.saved.append(path)
        self._timer.mark(step)
        log.info("saved checkpoint %s", path)


class LoggingHook(Hook):
    """Every N local steps: loss, global step, examples/sec and sec/batch (the classic multi-GPU line)."""

    def __init__(self, *, every_n_steps: int = 100) -> None:
        if every_n_steps < 1:
            raise InvalidArgumentError(f"every_n_steps={every_n_steps} must be at least 1")
        self.every_n_steps = every_n_steps
        self._seconds = 0.0
        self._examples = 0

    def after_step(self, session: Session, result: StepResult) -> None:
        self._seconds += result.seconds
        self._examples += result.batch_size or 0
        if result.local_step % self.every_n_steps:
            return
        sec_per_batch = self._seconds / self.every_n_steps
        rate = f"{self._examples / self._seconds:.1f} examples/sec; " if self._examples and self._seconds else ""
        log.info("%s: step %d, loss = %.4f (%s%.3f sec/batch)", session.replica.task.name, result.global_step,
                 result.loss, rate, sec_per_batch)
        self._seconds, self._examples = 0.0, 0


class NanLossHook(Hook):
    """What to do when the loss is NaN or infinite; nothing is ever pushed for such a step.

    Args:
        mode: ``"stop"`` raises NanLossError naming the step; ``"skip"`` drops the step, counts it
            (``skipped``), logs it and goes on.
    """

    MODES = ("stop", "skip")

    def __init__(self, *, mode: str = "stop") -> None:
        if mode not in self.MODES:
            raise InvalidArgumentError(f"NanLossHook mode={mode!r}: choose 'stop' or 'skip'")
        self.mode = mode
        self.skipped = 0
