"""SummaryHook: TensorBoard event files from the chief, readable by ``tensorboard --logdir``.

Scalars every ``save_steps`` global steps, and once more at the session's last
step so that a chart ends where training did: the loss, the learning rate the ps
applies at that step, examples/sec, and (sync mode only) the stale gradients the
ps dropped; with ``histograms=True`` also one histogram per parameter.  Written with
TensorBoard's own event-file writer (``torch.utils.tensorboard``).
``TrainingSession`` adds one by itself under ``tensorfleet launch`` (its ``summary_dir``).
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from tensorfleet.errors import NotInitializedError, UnavailableError
from tensorfleet.train.hooks import Hook, Session, StepResult, StepTimer


class SummaryHook(Hook):
    """Write scalar (and optionally histogram) summaries on the chief every ``save_steps`` global steps and at
    the end (the last step the chief saw, unless it was just written)."""

    def __init__(self, logdir: str | Path, *, save_steps: int = 100, histograms: bool = False) -> None:
        self.logdir = Path(logdir)
        self.histograms = histograms
        self._timer = StepTimer(every_steps=save_steps)
        self._writer: SummaryWriter | None = None
        self._seconds = 0.0
        self._examples = 0
        self._last_loss: float | None = None

    def after_create_session(self, session: Session) -> None:
        if session.replica.is_chief:
            self._writer = SummaryWriter(str(self.logdir))

    def after_step(self, session: Session, result: StepResult) -> None:
        if self._writer is None:
            return
        self._seconds += result.seconds
        self._examples += result.batch_size or 0
        self._last_loss = result.loss
        if self._timer.should_trigger(result.global_step):
            self._write(session, result.global_step, histograms=self.histograms)

    def end(self, session: Session) -> None:
        if self._writer is None:
            return
        # The final step (a StopAtStepHook's last_step) is rarely a multiple of save_steps: write it too.
        if self._last_loss is not None and session.global_step != self._timer.last_step:
            # no histograms: by now the module may hold what the caller loaded into it (moving averages)
            self._write(session, session.global_step, histograms=False)
        self._writer.close()

    def _write(self, session: Session, step: int, *, histograms: bool) -> None:
        """The scalars (and histograms) at ``step``; the loss is the chief's latest step's."""
        assert self._writer is not None and self._last_loss is not None
        self._timer.mark(step)
        self._writer.add_scalar("loss", self._last_loss, step)
        self._writer.add_scalar("learning_rate", session.replica.optimizer.learning_rate(step), step)
        if self._examples and self._seconds:
            self._writer.add_scalar("examples_per_sec", self._examples / self._seconds, step)
        if session.replica.sync is not None:  # only sync mode drops stale gradients: async saves the RPC
            try:
                dropped = session.fetch_dropped_stale_gradients()  # no pull: the model stays as is
                self._writer.add_scalar("dropped_stale_gradients", dropped, step)
            except (UnavailableError, NotInitializedError):
                pass  # the ps is restarting: the next step recovers; this one summary goes without the count
        if histograms:
            for name, param in session.replica.module.named_parameters():
                self._writer.add_histogram(name, param.detach(), step)
        self._writer.flush()
        self._seconds, self._examples = 0.0, 0
