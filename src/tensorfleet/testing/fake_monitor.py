"""A stand-in for the fleet monitor's ``picture()``, so the dashboard's page and routes can be tested on
a picture the test controls (the real monitor over a real fleet is tested end to end elsewhere)."""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any, Iterator

from tensorfleet.dashboard import Dashboard, FleetPicture


class FakeMonitor:
    """``picture()`` returns ``state`` (the picture's JSON, which a test edits inside ``with source.lock``) read
    as a ``FleetPicture``.

    ``broken = True`` makes ``picture()`` raise, as a monitor with a bug would.
    """

    def __init__(self, state: dict[str, Any]) -> None:
        self.lock = threading.Lock()
        self.state = state
        self.broken = False

    def picture(self) -> FleetPicture:
        with self.lock:
            if self.broken:
                raise RuntimeError("the fake monitor is broken on purpose")
            return FleetPicture.read(copy.deepcopy(self.state))


@contextlib.contextmanager
def serving(source: FakeMonitor) -> Iterator[Dashboard]:
    """A real Dashboard on a free loopback port over ``source``, stopped on exit."""
    dashboard = Dashboard(source.picture)
    dashboard.start()
    try:
        yield dashboard
    finally:
        dashboard.stop()
