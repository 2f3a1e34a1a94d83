"""One error hierarchy for tensorfleet.

Every error says whether it is *recoverable*: a recoverable error means "wait or
retry and it may go away" (a ps that is restarting, a chief that has not
initialized yet); an unrecoverable one means the input or the configuration is
wrong and retrying will give the same answer.

Errors carry the task (``/job:ps/task:0``) and the step where they happened when
those are known, so a log line names the culprit.
"""

from __future__ import annotations


class TensorfleetError(Exception):
    """Base of every error raised by tensorfleet.

    ``code`` is the status name the error travels as between tasks (gRPC's names, used on
    the data plane too); ``from_code`` turns it back into the same class on the other side.
    """

    recoverable: bool = False
    code: str = "INTERNAL"

    def __init__(self, message: str, *, task: str | None = None, step: int | None = None) -> None:
        self.message = message
        self.task = task
        self.step = step
        where = ", ".join(p for p in (task, None if step is None else f"step {step}") if p)
        super().__init__(f"{message} [{where}]" if where else message)


class ClusterSpecError(TensorfleetError, ValueError):
    """The cluster description (dict, TF_CONFIG or flags) is invalid. Not recoverable."""


class InvalidArgumentError(TensorfleetError, ValueError):
    """A request names an unknown variable, or a tensor of the wrong shape or dtype. Not recoverable."""

    code = "INVALID_ARGUMENT"


class WireError(InvalidArgumentError):
    """A message could not be encoded or decoded: malformed, oversized, unknown dtype. Not recoverable."""


class NotInitializedError(TensorfleetError):
    """The variables are not initialized yet: the chief has not run. Recoverable (wait for it)."""

    recoverable = True
    code = "FAILED_PRECONDITION"


class UnavailableError(TensorfleetError):
    """A task cannot be reached (not started yet, restarting, or dead). Recoverable (retry)."""

    recoverable = True
    code = "UNAVAILABLE"


class TimelineChangedError(NotInitializedError):
    """A push computed from values of a shard's earlier timeline: the shard was restored from a checkpoint (or
    restarted) since they were pulled, so the push is refused. Recoverable: pull again and compute the step
    again. It travels as FAILED_PRECONDITION and arrives as ``NotInitializedError``, which every training loop
    already recovers from."""


class DeadlineExceededError(TensorfleetError):
    """A call or a wait ran past its deadline. Recoverable, but it names what it waited for."""

    recoverable = True
    code = "DEADLINE_EXCEEDED"


class DataError(TensorfleetError, ValueError):
    """A data file is missing or not what it claims to be. Not recoverable."""


class LaunchError(TensorfleetError):
    """The launcher could not start or supervise the fleet. Not recoverable."""


class ConfigError(LaunchError, ValueError):
    """A launch or render setting (flag, TENSORFLEET_* variable, job file field) is wrong; nothing started."""

    code = "INVALID_ARGUMENT"


class UnauthenticatedError(TensorfleetError):
    """A call without the job's token (or with a wrong one) was refused. Not recoverable: fix the token."""

    code = "UNAUTHENTICATED"


class UnprovenServerError(UnauthenticatedError):
    """What answered at a task's address did not prove it is that task of this job (no token, another token,
    another program): nothing was sent to it and nothing it said was believed. Not recoverable by retrying at
    once: stop what holds the address, or give the task this job's token."""


class StaleIncarnationError(TensorfleetError):
    """A push from a worker process that has since been replaced (restarted). Not recoverable: this process
    should exit, its successor trains in its place."""

    code = "PERMISSION_DENIED"


class NanLossError(TensorfleetError):
    """The loss was NaN or infinite; nothing was pushed. Not recoverable by retrying the same step."""


_BY_CODE: dict[str, type[TensorfleetError]] = {
    cls.code: cls for cls in (InvalidArgumentError, NotInitializedError, UnavailableError, DeadlineExceededError,
                              UnauthenticatedError, StaleIncarnationError)}


def from_code(code: str, message: str, *, task: str | None = None) -> TensorfleetError:
    """The error a task reported as status ``code``; CANCELLED/ABORTED (a task going away) are UNAVAILABLE."""
    if code == "RESOURCE_EXHAUSTED":
        return WireError(f"message too large for the limit: {message}", task=task)
    if code in ("CANCELLED", "ABORTED"):
        return UnavailableError(f"the call was {code.lower()} by a task going away: {message}", task=task)
    cls = _BY_CODE.get(code)
    return cls(message, task=task) if cls else TensorfleetError(f"{code}: {message}", task=task)
