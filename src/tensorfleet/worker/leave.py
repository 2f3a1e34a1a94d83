"""Leaving a running job when asked: how a worker is scaled away.

When an asynchronous job is scaled down, the launcher sends each worker it removes
``LEAVE_SIGNAL`` (SIGUSR1; not SIGTERM, which stops a task at once when the whole job
is stopped, or when the launcher dies).  The handler only sets a flag; the training
loop reads it between steps: ``TrainingSession.should_stop()`` turns true, the loop
ends after the step it is in, the session ends cleanly (hooks' ``end``, then Done to
every ps) and the task exits 0.  A loop of its own (a bare ``Replica``) can do the same
with ``leave_requested()``.

``TrainingSession`` installs the handler when it starts (main thread only: Python runs
signal handlers there).  A worker that never installs it dies of the signal instead,
without its Done; the launcher then tells the ps that it left (``Resize``), so the job
goes on either way.
"""

from __future__ import annotations

import signal
import threading

LEAVE_SIGNAL = signal.SIGUSR1

_requested = False  # a plain flag: a signal handler must not take locks the interrupted code may hold
_installed = False


def install_leave_handler() -> bool:
    """Make ``LEAVE_SIGNAL`` ask this process to leave, once per process; False off the main thread (not
    installed: Python delivers signals to the main thread only)."""
    global _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(LEAVE_SIGNAL, lambda _signum, _frame: request_leave())
    _installed = True
    return True


def leave_requested() -> bool:
    """True once this worker was asked to leave the job: finish the current step, then end training."""
    return _requested


def request_leave() -> None:
    """Ask this process to leave, as the signal does (for tests and in-process callers)."""
    global _requested
    _requested = True
