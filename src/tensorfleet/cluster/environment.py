"""What a task learns from the environment the launcher gives it.

``tensorfleet launch`` (``backends/launcher.py``) starts every task with, besides ``TF_CONFIG``:

* ``TENSORFLEET_STATUS_DIR``: the job's log directory, where a task leaves its last Status as it
  exits (``worker/status.py``, ``write_final_status``), so that the launcher's summary and
  dashboard show the final step.  Its presence also says that a supervisor is watching every
  exit: a finished ps then need not linger (``finished_linger_s``).
* ``TENSORFLEET_LOGDIR``: the job's ``--logdir``, where the chief writes its TensorBoard
  summaries (``train/session.py``, ``default_summary_dir``).
* ``TENSORFLEET_IN_GRAPH=1``, for a job of in-graph replication (``--coordinator`` or
  ``--coordinator-outside``): its script must call ``run_coordinated``; ``run_task`` (a between-graph
  script) refuses to run in it (a ``chief`` job in TF_CONFIG alone does not say so: a TFJob has one too).

A task started by other means (by hand, by Kubernetes) has neither, and works without them.
They live here, low in the layers, because both a ps and a worker read them (and a ps must not
import the worker layer).  Read when asked, never at import.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

from tensorfleet.errors import ConfigError

STATUS_DIR_ENV = "TENSORFLEET_STATUS_DIR"
# The job's --logdir, set by `tensorfleet launch` for every task: where the chief writes TensorBoard summaries.
LOGDIR_ENV = "TENSORFLEET_LOGDIR"
# Set by `tensorfleet launch --coordinator` (and --coordinator-outside) for every task: the job is in-graph replication.
IN_GRAPH_ENV = "TENSORFLEET_IN_GRAPH"
# In the logdir of `tensorfleet launch --coordinator-outside`: what a Python session needs to join the fleet as its
# coordinator (its TF_CONFIG, and the file holding the job token: tensorfleet.coordinator.outside.join_fleet).
COORDINATOR_FILE = "coordinator.json"
COORDINATOR_TOKEN_FILE = "coordinator.token"


# How long a finished ps keeps answering Status ("done") when no launcher is there to read its final
# status file: a dashboard attached by hand polls about once a second, and must see the end.
FINISHED_LINGER_S = 2.0


def env_switch(name: str, *, default: bool, meaning: str, environ: Mapping[str, str] | None = None) -> bool:
    """A yes/no setting from the environment: 1/true/on/yes or 0/false/off/no (any case), unset or empty
    for ``default``; anything else is a ConfigError naming the variable, with ``meaning`` (what 1 and 0
    do) as the help."""
    text = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if text == "":
        return default
    if text in ("1", "true", "on", "yes"):
        return True
    if text in ("0", "false", "off", "no"):
        return False
    raise ConfigError(f"{name}={text!r}: give {meaning}")


def finished_linger_s() -> float:
    """``FINISHED_LINGER_S``, or 0 under ``tensorfleet launch``: its supervisor sees every exit (and the
    final status file), and lingering there would only delay the end of every job."""
    return 0.0 if os.environ.get(STATUS_DIR_ENV) else FINISHED_LINGER_S


@contextlib.contextmanager
def temporary_environ(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` set in this process's environment for the block, then what was there put back (or removed):
    for libraries that read a variable when they start (Gloo's and TensorPipe's interface, say)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
