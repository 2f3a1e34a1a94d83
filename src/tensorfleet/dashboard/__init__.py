"""The live dashboard: a web page, JSON and Prometheus metrics over the fleet monitor's picture.

The dashboard never talks to the tasks.  It is given ``picture()`` (a ``PictureSource``,
``FleetMonitor.picture`` in the launcher), a cheap, thread-safe callable that returns a
fresh ``FleetPicture`` (``tensorfleet.dashboard.picture``: the job, each task, a bounded
history) each call; ``/api/status`` serves its ``to_json()``, ``/metrics`` its figures.

Example:
    >>> from tensorfleet.dashboard import Dashboard
    >>> with Dashboard(monitor.picture) as dashboard:
    ...     print(f"dashboard: {dashboard.url}")
    ...     supervise()
"""

from tensorfleet.dashboard.metrics import render_metrics
from tensorfleet.dashboard.picture import FleetPicture, HistoryPoint, JobPicture, TablePart, TaskPicture
from tensorfleet.dashboard.server import Dashboard, PictureSource, create_app

__all__ = ["Dashboard", "FleetPicture", "HistoryPoint", "JobPicture", "PictureSource", "TablePart", "TaskPicture",
           "create_app", "render_metrics"]
