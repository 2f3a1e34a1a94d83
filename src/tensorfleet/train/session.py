"""TrainingSession: the worker's side of training, as ``tf.train.MonitoredTrainingSession``.

    with TrainingSession(replica, hooks=[StopAtStepHook(last_step=10000)],
                         checkpoint_dir="runs/1", save_checkpoint_steps=1000) as session:
        while not session.should_stop():
            images, labels = next(data)
            session.run_step(lambda: loss_fn(model(images), labels), batch_size=len(labels))

The order of events (as MTS): every hook's ``begin``; the fleet starts (the chief
restores the latest checkpoint of ``checkpoint_dir`` if the ps is empty, else
initializes; other workers wait for it); every hook's ``after_create_session``;
then per step ``before_step``, pull, the closure's forward, backward, push,
``after_step``.  Leaving the block cleanly runs every hook's ``end``; running out
of data (StopIteration) counts as a clean end.  The replica then tells the ps it
is done, so the ps exits when every worker has.

When a ps dies mid-step (UNAVAILABLE, or an empty restarted ps) or stops answering
(DEADLINE_EXCEEDED: a partition, a ps that hangs), the step waits for it to answer again (bounded by ``recovery_timeout_s``, with log lines), the chief
rolls every shard back to the latest checkpoint (``Replica.recover``), and the step
is run again from the restored parameters.

A step whose loss is NaN or infinite never reaches the ps: the gradients are
dropped before the push, and a ``NanLossHook`` decides whether that stops
training (the default, with a clear error) or skips the step.

Scaled away: when the launcher removes this worker from an asynchronous job (a
scale-down), it sends the leave signal (``tensorfleet.worker.leave``, installed as the
session starts); ``should_stop()`` then turns true, the loop ends after its current
step, and the clean end above tells the ps this worker is done.  The task exits 0.

TensorBoard by default, as MTS's ``summary_dir``: under ``tensorfleet launch``
(which sets ``TENSORFLEET_LOGDIR`` for every task) the chief writes summaries to
``LOGDIR/train``, so ``tensorboard --logdir LOGDIR`` shows the job without a line
of code; ``summary_dir=`` points them elsewhere (a script run by hand), ``False``
turns them off, and a ``SummaryHook`` of the caller's own replaces the default.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch

from tensorfleet.cluster.environment import LOGDIR_ENV
from tensorfleet.errors import DeadlineExceededError, NanLossError, NotInitializedError, UnavailableError
from tensorfleet.protocol.status import PsStatus
from tensorfleet.train.checkpoint import Checkpointer, latest_checkpoint, load, split_for
from tensorfleet.train.hooks import CheckpointSaverHook, Hook, LoggingHook, NanLossHook, StepResult
from tensorfleet.worker.leave import install_leave_handler, leave_requested
from tensorfleet.worker.training_replica import TrainingReplica, ended_cleanly

log = logging.getLogger(__name__)

MAX_STEP_ATTEMPTS = 3  # a step is retried after each recovery; the third failure propagates
SUMMARY_SUBDIR = "train"  # the chief's event files under the launcher's logdir (a run named "train" in TensorBoard)


def default_summary_dir() -> Path | None:
    """``$TENSORFLEET_LOGDIR/train`` when ``tensorfleet launch`` started this task, else None."""
    logdir = os.environ.get(LOGDIR_ENV)
    return Path(logdir) / SUMMARY_SUBDIR if logdir else None


def _summary_hooks(summary_dir: str | Path | Literal[False] | None, save_steps: int,
                   given: Sequence[Hook]) -> list[Hook]:
    """The chief's SummaryHook asked for by ``summary_dir`` (see TrainingSession), or none."""
    if summary_dir is False:
        return []
    directory = default_summary_dir() if summary_dir is None else Path(summary_dir)
    if directory is None:
        return []
    from tensorfleet.train.summary import SummaryHook  # only the chief pays for TensorBoard's writer
    if summary_dir is None and any(isinstance(hook, SummaryHook) for hook in given):
        return []  # the caller's own summaries replace the default ones
    return [SummaryHook(directory, save_steps=save_steps)]


class TrainingSession:
    """Owns a replica's training: start (init or restore), hooks, steps, stop, and a clean end.

    Args:
        replica: the worker's model bound to the ps (not started yet).
        hooks: run on every worker.
        chief_only_hooks: run on the chief only (summaries, extra savers).
        checkpoint_dir: where the chief saves checkpoints and restores from; None: no checkpoints.
        save_checkpoint_steps / save_checkpoint_secs: how often to save, either or both (default: every 600 s).
        max_to_keep: checkpoints kept in ``checkpoint_dir``.
        full_checkpoint_every: 1: every checkpoint whole; N: a full checkpoint, then N-1 delta checkpoints
            holding only the embedding rows changed (and evicted) since the previous one.
        background_checkpoints: the chief pauses only until every shard has taken its state (a copy under its
            lock); the rows travel and a thread writes the file (the session's end waits for it).
        log_step_count_steps: a LoggingHook line every N local steps (None: no log lines).
        summary_dir: where the chief writes TensorBoard summaries (a SummaryHook every
            ``save_summaries_steps`` global steps and at the last step). None (default):
            ``$TENSORFLEET_LOGDIR/train`` under ``tensorfleet launch`` unless ``hooks`` or
            ``chief_only_hooks`` hold a SummaryHook already, and none when run by hand. False: none.
        save_summaries_steps: how often the summaries asked for by ``summary_dir`` are written.
        recovery_timeout_s: how long a step waits for a lost ps to come back before failing.
    """

    def __init__(self, replica: TrainingReplica, *, hooks: Sequence[Hook] = (), chief_only_hooks: Sequence[Hook] = (),
                 checkpoint_dir: str | Path | None = None, save_checkpoint_steps: int | None = None,
                 save_checkpoint_secs: float | None = None, max_to_keep: int = 5, full_checkpoint_every: int = 1,
                 background_checkpoints: bool = False,
                 log_step_count_steps: int | None = 100, summary_dir: str | Path | Literal[False] | None = None,
                 save_summaries_steps: int = 100, recovery_timeout_s: float = 300.0) -> None:
        self.replica = replica
        self.recovery_timeout_s = recovery_timeout_s
        self.recoveries = 0
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.hooks: list[Hook] = list(chief_only_hooks) if replica.is_chief else []
        if replica.is_chief:
            self.hooks += _summary_hooks(summary_dir, save_summaries_steps, [*hooks, *chief_only_hooks])
        if self.checkpoint_dir is not None and replica.is_chief:
            self.hooks.append(CheckpointSaverHook(self.checkpoint_dir, save_steps=save_checkpoint_steps,
                                                  save_secs=save_checkpoint_secs, max_to_keep=max_to_keep,
                                                  full_every=full_checkpoint_every,
                                                  background=background_checkpoints))
        if log_step_count_steps:
            self.hooks.append(LoggingHook(every_n_steps=log_step_count_steps))
        self.hooks += list(hooks)
        self._nan_hook = next((h for h in self.hooks if isinstance(h, NanLossHook)), NanLossHook(mode="stop"))
        self._stop_requested = False
        self._skip = 0  # run_step calls to skip: a closure re-run after its worker was lost (``skip_pushed_steps``)
        self.local_step = 0
        self.last_result: StepResult | None = None  # the latest run_step's

    # --- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> "TrainingSession":
        install_leave_handler()  # a scale-down's signal asks the loop to stop after its step (should_stop)
        for hook in self.hooks:
            hook.begin(self)
        if self.checkpoint_dir is not None:
            Checkpointer(self.checkpoint_dir).start(self.replica)
        else:
            self.replica.start()
        for hook in self.hooks:
            hook.after_create_session(self)
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> bool:
        clean = ended_cleanly(exc_type)
        ended = False  # the hooks' end() ran through too (a failed last save is a failure: no Done)
        try:
            if clean:
                for hook in self.hooks:
                    hook.end(self)
                ended = True
        finally:
            if ended:
                self.replica.finish()
            else:
                try:
                    self.replica.finish(done=False)  # no Done: a restarted worker takes this one's place
                except Exception:  # noqa: BLE001 - the error that ended training is the one to report
                    log.warning("%s: could not close the replica's channels", self.replica.task.name,
                                exc_info=True)
        return clean and exc_type is not None  # swallow StopIteration: running out of data ends training

    # --- the loop --------------------------------------------------------------------------------

    @property
    def global_step(self) -> int:
        """The global step as of this worker's last pull or push (no RPC)."""
        return self.replica.global_step

    # --- what hooks ask the ps, without touching the model ------------------------------------------
    # Both reach through the replica's client to ps 0: for now this is the one place that does (the
    # Replica is to get methods of its own for them); hooks call these, never ``replica.client``.

    def fetch_global_step(self) -> int:
        """ps 0's global step now, asked over the control plane: nothing is pulled, the model stays as is.

        Raises:
            UnavailableError, NotInitializedError: ps 0 is down or restarting.
        """
        return self.replica.client.global_step()

    def fetch_dropped_stale_gradients(self) -> int:
        """How many stale gradients ps 0 has dropped (sync mode), from its Status; nothing is pulled.

        Raises:
            UnavailableError, NotInitializedError: ps 0 is down or restarting.
        """
        return PsStatus.from_meta(self.replica.client.channels[0].call("Status")[0]).dropped_stale

    def should_stop(self) -> bool:
        """True once a hook requested a stop, or the launcher asked this worker to leave the job."""
        if not self._stop_requested and leave_requested():
            log.info("%s: asked to leave the job (scaled down); stopping after %d local step(s), at global step %d",
                     self.replica.task.name, self.local_step, self.global_step)
            self._stop_requested = True
        return self._stop_requested

    def request_stop(self) -> None:
        self._stop_requested = True

    def run_step(self, closure: Callable[[], torch.Tensor], *, batch_size: int | None = None) -> StepResult:
        """One step: pull, ``loss = closure()``, backward, push. Returns what happened.

        Raises:
            RuntimeError: a hook already requested a stop (check ``should_stop()`` first).
            NanLossError: the loss was not finite and the NanLossHook's mode is "stop".
        """
        if self._stop_requested:
            raise RuntimeError("run_step() after a stop was requested: check should_stop() in the loop")
        if self._skip:  # already pushed by this worker's previous process, in the closure run again now
            self._skip -= 1
            return StepResult(loss=float("nan"), global_step=self.replica.global_step, local_step=self.local_step,
                              seconds=0.0, batch_size=batch_size, dropped=False, skipped=True)
        for hook in self.hooks:
            hook.before_step(self)
        start = time.perf_counter()
        for attempt in range(MAX_STEP_ATTEMPTS):
            try:
                value, dropped, skipped = self._step(closure)
                break
            except (UnavailableError, DeadlineExceededError, NotInitializedError) as exc:
                if attempt == MAX_STEP_ATTEMPTS - 1:
                    raise
                log.warning("%s: step failed (%s); recovering", self.replica.task.name, exc)
                self.recover()
        self.local_step += 1
        self.replica.report(loss=value, examples=batch_size or 0)
        result = StepResult(loss=value, global_step=self.replica.global_step, local_step=self.local_step,
                            seconds=time.perf_counter() - start, batch_size=batch_size, dropped=dropped,
                            skipped=skipped)
        self.last_result = result
        for hook in self.hooks:
            hook.after_step(self, result)
        return result

    def skip_pushed_steps(self, began_at_step: int) -> int:
        """Synchronous training under a coordinator: a closure that began at global step ``began_at_step`` on
        this worker's previous process (lost mid-closure) runs again here. The steps aggregated since then
        include that process's pushes, so the next that many ``run_step`` calls are skipped (nothing pulled,
        computed or pushed; a ``StepResult`` with ``skipped``): the replica meets its partners at the step they
        wait on, instead of running those steps again behind them and leaving its last ones without partners.
        Returns how many are skipped; ``end_skipping`` drops what the closure did not use."""
        try:
            self._skip = max(0, self.fetch_global_step() - began_at_step)
        except (UnavailableError, DeadlineExceededError, NotInitializedError) as exc:  # ps 0 lost meanwhile
            log.warning("%s: cannot tell the global step (%s): this closure runs every step again",
                        self.replica.task.name, exc)
            self._skip = 0
        if self._skip:
            log.warning("%s: this closure began at global step %d on this worker's previous process; the %d "
                        "step(s) aggregated since are skipped, to meet the other replicas at global step %d",
                        self.replica.task.name, began_at_step, self._skip, began_at_step + self._skip)
        return self._skip

    def end_skipping(self) -> None:
        """The closure ``skip_pushed_steps`` was for has ended: the next steps run."""
        self._skip = 0

    def after_remote_steps(self, result: StepResult) -> None:
        """Steps this session did not run itself but drives: a coordinator's closure, run on a worker
        (``tensorfleet.coordinator``). The hooks see each closure as one step of this session (``local_step``
        counts closures), at the global step the worker saw after it; checkpoints, summaries and stop
        conditions follow training as on a chief that trains."""
        self.local_step = result.local_step
        self.replica.global_step = max(self.replica.global_step, result.global_step)
        # the coordinator's Status says the closures' loss and examples (the progress line's, the dashboard's)
        self.replica.report(loss=result.loss if math.isfinite(result.loss) else None,
                            examples=result.batch_size or 0)
        for hook in self.hooks:
            hook.after_step(self, result)

    def _step(self, closure: Callable[[], torch.Tensor]) -> tuple[float, bool, bool]:
        """Pull, compute, push once; return (loss, dropped by the ps, skipped as non-finite)."""
        self.replica.pull()
        loss = closure()
        value = float(loss.detach())
        if not math.isfinite(value):
            self._on_nonfinite(value)
            return value, False, True
        loss.backward()
        dropped_before = self.replica.dropped_gradients
        self.replica.push()
        return value, self.replica.dropped_gradients > dropped_before, False

    def recover(self) -> None:
        """A ps went away: wait for it, let the chief restore the latest checkpoint onto every shard, go on.
        A step that fails calls it; so does a coordinator, which runs no steps, when it finds a ps lost."""
        restore = None
        if self.replica.is_chief and self.checkpoint_dir is not None:
            latest = latest_checkpoint(self.checkpoint_dir)
            if latest is not None:
                state = load(latest).state
                restore = split_for(self.replica, state)  # hybrid: the workers keep their live dense half
        started = time.monotonic()
        self.replica.recover(restore=restore, timeout_s=self.recovery_timeout_s)
        self.recoveries += 1
        log.warning("%s: recovered in %.2f s (recovery %d), at global step %d", self.replica.task.name,
                    time.monotonic() - started, self.recoveries, self.global_step)

    def _on_nonfinite(self, value: float) -> None:
        for param in self.replica.module.parameters():
            param.grad = None
        where = f"{self.replica.task.name}, local step {self.local_step + 1}, global step {self.global_step}"
        if self._nan_hook.mode == "stop":
            raise NanLossError(f"the loss is {value} at {where}; nothing was pushed. Lower the learning rate, "
                               "check the data, or use NanLossHook(mode='skip') to skip such steps")
        self._nan_hook.skipped += 1
        log.warning("the loss is %s at %s; step skipped, nothing pushed (%d skipped so far)",
                    value, where, self._nan_hook.skipped)

