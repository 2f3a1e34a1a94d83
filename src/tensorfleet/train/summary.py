"""SummaryHook: TensorBoard event files from the chief, readable by ``tensorboard --logdir``.

Scalars every ``save_steps`` global steps: the loss, the learning rate the ps
applies at that step, examples/sec, and the stale gradients the ps dropped (sync
mode); with ``histograms=True`` also one histogram per parameter.  Written with
TensorBoard's own event-file writer (``torch.utils.tensorboard``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from torch.utils.tensorboard import SummaryWriter

from tensorfleet.errors import NotInitializedError, UnavailableError
from tensorfleet.train.hooks import Hook, StepResult, StepTimer

if TYPE_CHECKING:
    from tensorfleet.train.session import TrainingSession


class SummaryHook(Hook):
    """Write scalar (and optionally histogram) summaries on the chief every ``save_steps`` global steps."""

    def __init__(self, logdir: str | Path, *, save_steps: int = 100, histograms: bool = False) -> None:
        self.logdir = Path(logdir)
        self.histograms = histograms
        self._timer = StepTimer(every_steps=save_steps)
        self._writer: SummaryWriter | None = None
        self._seconds = 0.0
        self._examples = 0

    def after_create_session(self, session: "TrainingSession") -> None:
        if session.replica.is_chief:
            self._writer = SummaryWriter(str(self.logdir))

    def after_step(self, session: "TrainingSession", result: StepResult) -> None:
        if self._writer is None:
            return
        self._seconds += result.seconds
        self._examples += result.batch_size or 0
        step = result.global_step
        if not self._timer.should_trigger(step):
            return
        self._timer.mark(step)
        self._writer.add_scalar("loss", result.loss, step)
        self._writer.add_scalar("learning_rate", session.replica.optimizer.learning_rate(step), step)
        if self._examples and self._seconds:
            self._writer.add_scalar("examples_per_sec", self._examples / self._seconds, step)
        try:
            status = session.replica.client.channels[0].call("Status")[0]  # no pull: the model stays as it is
            self._writer.add_scalar("dropped_stale_gradients", status["dropped_stale"], step)
        except (UnavailableError, NotInitializedError):
            pass  # the ps is restarting: the next step recovers; this one summary goes without the count
        if self.histograms:
            for name, param in session.replica.module.named_parameters():
                self._writer.add_histogram(name, param.detach(), step)
        self._writer.flush()
        self._seconds, self._examples = 0.0, 0

    def end(self, session: "TrainingSession") -> None:
        if self._writer is not None:
            self._writer.close()
