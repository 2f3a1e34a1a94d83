"""A Python session (a notebook, a REPL) as the coordinator of a fleet that ``tensorfleet launch
--coordinator-outside`` started: the launcher starts and restarts the ps and workers, and leaves in its logdir what
the session needs to join (``coordinator.json``: the chief's TF_CONFIG, and the job token's file, readable by this
user only). Both are read only from a logdir no other user can write, and only if they are this user's own files,
private (``private_logdir``): a planted coordinator.json would name another fleet and its token. The session then initializes the ps in a ``TrainingSession`` and drives the workers with a
``Coordinator``, one cell at a time; the job ends when the session's ``TrainingSession`` does.

The workers run the script the launcher was given; the session imports the same script as a module, so that the
``@tfl.remote`` functions it schedules are those the workers hold (they travel by name).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Iterator

from tensorfleet.cluster.environment import COORDINATOR_FILE, COORDINATOR_TOKEN_FILE
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, from_tf_config
from tensorfleet.errors import ConfigError, DeadlineExceededError
from tensorfleet.train.atomic import READ, WRITE, others_may, private_directory_problem
from tensorfleet.wire import auth
from tensorfleet.worker.status import serve_status

POLL_S = 0.1
MAX_HAND_OVER_BYTES = 1 << 20  # coordinator.json and the token are small: no more is read of either
log = logging.getLogger(__name__)


def join_fleet(logdir: str | Path, *, timeout_s: float = 120.0) -> tuple[ClusterSpec, TaskSpec]:
    """Join the fleet launched with ``--coordinator-outside --logdir LOGDIR`` as its coordinator: return the cluster
    and this process's task (the chief), with the job token set for this process's channels and the chief's
    Status served (the launcher and the dashboard see the session).

    Raises:
        DeadlineExceededError: no launcher left ``LOGDIR/coordinator.json`` within ``timeout_s``.
        ConfigError: the file or the token cannot be read, or the launcher that left it is gone (a finished job's
            file: its fleet is not there to join), or another user could have written the logdir or either file.
    """
    path = Path(logdir) / COORDINATOR_FILE
    start = f"start the fleet with 'tensorfleet launch --coordinator-outside --logdir {logdir} SCRIPT'"
    deadline = time.monotonic() + timeout_s
    if not os.path.lexists(path):  # said at once: the fleet may be starting, or it was never started
        log.warning("waiting up to %g s for %s: %s (and this same logdir)%s", timeout_s, path, start,
                    "" if Path(logdir).is_dir() else f"; {logdir} does not exist yet")
    while not os.path.lexists(path):  # a link too: refused below, not waited for
        if time.monotonic() > deadline:
            raise DeadlineExceededError(f"no {path} after {timeout_s:g} s: {start} (and this same logdir)")
        time.sleep(POLL_S)
    with private_logdir(Path(logdir)) as directory:
        try:
            joining = json.loads(_read_own_file(directory, path, secret=False))
            cluster, task = from_tf_config(joining["tf_config"])
            launcher = joining.get("launcher_pid")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path} cannot be read as a fleet to join ({exc}): start the fleet again") from None
        if not _alive(launcher):
            raise ConfigError(f"{path} was left by a launcher that has ended (pid {launcher}): its fleet is gone; "
                              f"{start} again")
        token = _read_own_file(directory, Path(logdir) / COORDINATOR_TOKEN_FILE, secret=True).strip()
    os.environ[auth.TOKEN_ENV] = token  # every channel this process opens proves the job's token
    server = serve_status(cluster, task)
    if server is not None:
        atexit.register(server.stop, 0)
    return cluster, task


@contextlib.contextmanager
def private_logdir(logdir: Path) -> Iterator[int]:
    """The open ``logdir``, once it is known that no other user can write it: there, a planted coordinator.json
    could name their fleet and token (this session would then train for them, and send them its model). The
    files are then read by name in it, checked on their open descriptors, so that what is checked is what is
    read; ConfigError says what is wrong and what to run."""
    try:
        directory = os.open(logdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{logdir} cannot be opened ({exc.strerror}): start the fleet again") from None
    try:
        problem = private_directory_problem(directory)
        if problem is not None:
            acl = f" and 'setfacl -b {logdir}'" if "ACL" in problem else ""
            raise ConfigError(f"not joining: the logdir {logdir} is not private: {problem}; another user could have "
                              f"planted a {COORDINATOR_FILE} naming their fleet and token. Run 'chmod go-w {logdir}'"
                              f"{acl} (or give the launcher a --logdir of your own) and start the fleet again")
        yield directory
    finally:
        os.close(directory)


def _read_own_file(directory: int, path: Path, *, secret: bool) -> str:
    """The text of ``path`` (a name in the open ``directory``), refused unless it is a regular file of this user
    that no other user may write (nor read, for a ``secret``): never through a link."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        descriptor = os.open(path.name, flags, dir_fd=directory)
    except OSError as exc:
        why = "it is a symbolic link, not the launcher's file" if exc.errno == errno.ELOOP else exc.strerror
        raise ConfigError(f"not joining: {path} cannot be read ({why}): start the fleet again") from None
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(descriptor)
        problem = _not_own_file(info, descriptor, secret=secret)
        if problem is not None:
            raise ConfigError(f"not joining: {path} {problem}: it is not the launcher's file (that one is yours, "
                              f"mode 600); remove it and start the fleet again")
        return handle.read(MAX_HAND_OVER_BYTES).decode("utf-8", errors="replace")


def _not_own_file(info: os.stat_result, descriptor: int, *, secret: bool) -> str | None:
    """What makes the open file no file of this user's alone, as a phrase, or None."""
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != os.geteuid():
        return f"belongs to another user (uid {info.st_uid})"
    problem = others_may(info, descriptor, WRITE) or (others_may(info, descriptor, READ) if secret else None)
    return None if problem is None else f"is not private: {problem}"


def _alive(pid: object) -> bool:
    """Whether the launcher of pid ``pid`` (of this machine: the session joins a fleet launched here) still runs."""
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user took the pid: not our launcher
        return False
    return True
