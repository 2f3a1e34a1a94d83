"""The live dashboard: a web page, JSON and Prometheus metrics over the fleet monitor's picture.

The dashboard never talks to the tasks.  It is given ``picture()`` (a ``PictureSource``,
``FleetMonitor.picture`` in the launcher), a cheap, thread-safe callable that returns a
fresh JSON-ready dict (a ``FleetPicture``) each call; ``/api/status`` serves it as is::

    {
      "job": {"name", "mode": "async" | "sync" | None, "state": "running" | "succeeded" | "failed",
              "global_step", "target_step" | None, "steps_per_sec" | None, "examples_per_sec" | None,
              "eta_s" | None, "dropped_stale", "elapsed_s", "restarts",
              "table_rows" | None, "rows_per_sec" | None},          # embedding tables: all shards
      "tasks": [{"name": "ps:0", "role": "ps" | "chief" | "worker", "address",
                 "state": "starting" | "running" | "restarting" | "done" | "failed" | "unreachable",
                 "pid" | None, "restarts", "step" | None, "global_step" | None, "loss" | None,
                 "examples_per_sec" | None, "heartbeat_age_s" | None, "exit_code" | None,
                 "tables": {name: {"rows", "bytes", "rows_per_sec" | None}} | None,   # a ps with tables
                 "unique_ids" | None}],                                   # a worker of a model with tables
      "history": [{"t", "global_step", "loss" | None, "examples_per_sec" | None,
                   "steps_per_sec" | None}],   # oldest first, bounded
    }

Example:
    >>> from tensorfleet.dashboard import Dashboard
    >>> with Dashboard(monitor.picture) as dashboard:
    ...     print(f"dashboard: {dashboard.url}")
    ...     supervise()
"""

from tensorfleet.dashboard.metrics import render_metrics
from tensorfleet.dashboard.server import Dashboard, FleetPicture, PictureSource, create_app

__all__ = ["Dashboard", "FleetPicture", "PictureSource", "create_app", "render_metrics"]
