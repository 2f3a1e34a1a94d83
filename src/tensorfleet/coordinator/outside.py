"""A Python session (a notebook, a REPL) as the coordinator of a fleet that ``tensorfleet launch
--coordinator-outside`` started: the launcher starts and restarts the ps and workers, and leaves in its logdir what
the session needs to join (``coordinator.json``: the chief's TF_CONFIG, and the job token's file, readable by this
user only). The session then initializes the ps in a ``TrainingSession`` and drives the workers with a
``Coordinator``, one cell at a time; the job ends when the session's ``TrainingSession`` does.

The workers run the script the launcher was given; the session imports the same script as a module, so that the
``@tfl.remote`` functions it schedules are those the workers hold (they travel by name).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
from pathlib import Path

from tensorfleet.cluster.environment import COORDINATOR_FILE
from tensorfleet.cluster.spec import ClusterSpec, TaskSpec, from_tf_config
from tensorfleet.errors import ConfigError, DeadlineExceededError
from tensorfleet.wire import auth
from tensorfleet.worker.status import serve_status

POLL_S = 0.1
log = logging.getLogger(__name__)


def join_fleet(logdir: str | Path, *, timeout_s: float = 120.0) -> tuple[ClusterSpec, TaskSpec]:
    """Join the fleet launched with ``--coordinator-outside --logdir LOGDIR`` as its coordinator: return the cluster
    and this process's task (the chief), with the job token set for this process's channels and the chief's
    Status served (the launcher and the dashboard see the session).

    Raises:
        DeadlineExceededError: no launcher left ``LOGDIR/coordinator.json`` within ``timeout_s``.
        ConfigError: the file or the token it names cannot be read, or the launcher that left it is gone (a
            finished job's file: its fleet is not there to join).
    """
    path = Path(logdir) / COORDINATOR_FILE
    start = f"start the fleet with 'tensorfleet launch --coordinator-outside --logdir {logdir} SCRIPT'"
    deadline = time.monotonic() + timeout_s
    if not path.exists():  # said at once: the fleet may be starting, or it was never started
        log.warning("waiting up to %g s for %s: %s (and this same logdir)%s", timeout_s, path, start,
                    "" if Path(logdir).is_dir() else f"; {logdir} does not exist yet")
    while not path.exists():
        if time.monotonic() > deadline:
            raise DeadlineExceededError(f"no {path} after {timeout_s:g} s: {start} (and this same logdir)")
        time.sleep(POLL_S)
    try:
        joining = json.loads(path.read_text(encoding="utf-8"))
        token = Path(joining["token_file"]).read_text(encoding="utf-8").strip()
        cluster, task = from_tf_config(joining["tf_config"])
        launcher = joining.get("launcher_pid")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} cannot be read as a fleet to join ({exc}): start the fleet again") from None
    if not _alive(launcher):
        raise ConfigError(f"{path} was left by a launcher that has ended (pid {launcher}): its fleet is gone; "
                          f"{start} again")
    os.environ[auth.TOKEN_ENV] = token  # every channel this process opens proves the job's token
    server = serve_status(cluster, task)
    if server is not None:
        atexit.register(server.stop, 0)
    return cluster, task


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
