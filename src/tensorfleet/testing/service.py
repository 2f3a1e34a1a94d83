"""A job service for tests: in-process, on a free loopback port, with an admin and its API token.

``running_service`` yields a started ``ServiceUnderTest``; on exit it closes the service and stops
every job still running (runners outlive a closed service on purpose, so a test that closes one to
"restart" it must still end what it started).
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tensorfleet.cli.service import Client
from tensorfleet.service.local import is_runner, process_state
from tensorfleet.service.server import Service, absolute
from tensorfleet.service.store import ACTIVE, JobStore

ADMIN_PASSWORD = "admin-password-for-tests"


@dataclass
class ServiceUnderTest:
    service: Service
    token: str  # the admin's API token

    @property
    def url(self) -> str:
        return self.service.url

    def client(self, token: str | None = None) -> Client:
        return Client(self.url, token or self.token)

    def job(self, job_id: int) -> dict[str, Any]:
        return self.client().call("GET", f"/api/jobs/{job_id}")


def start_service(home: Path, workspace: Path, **options: Any) -> ServiceUnderTest:
    """A started service over ``home`` (created with an admin on first use) and ``workspace``."""
    service = Service(home, workspace, **options)
    if not service.accounts.has_users():
        service.accounts.add_user("admin", ADMIN_PASSWORD, admin=True)
    token = service.accounts.new_api_token("admin")
    return ServiceUnderTest(service.start(), token)


def stop_runners(home: Path, timeout_s: float = 30.0) -> None:
    """End every runner of ``home``: SIGTERM those of active jobs, wait for all (a runner that recorded its
    outcome is still exiting), SIGKILL what is left after ``timeout_s``."""
    store_path = absolute(home) / "jobs.sqlite"  # as the service resolved it: what its runners were given
    if not store_path.is_file():  # no service ever started there (its port was taken, say): no runners
        return
    with JobStore(store_path) as store:
        runners = [(job.pid, job.id, job.state in ACTIVE) for job in store.list() if job.pid]
    live = [(pid, job_id) for pid, job_id, active in runners if is_runner(pid, store_path, job_id)]
    for pid, job_id, active in runners:
        if active and (pid, job_id) in live:
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    # Not until each is a zombie: an exiting process loses its command line first (``is_runner`` says no early).
    while time.monotonic() < deadline and any(process_state(pid) not in (None, "Z") for pid, _ in live):
        time.sleep(0.05)
    for pid, job_id in live:
        if is_runner(pid, store_path, job_id):
            os.kill(pid, signal.SIGKILL)


@contextmanager
def running_service(home: Path, workspace: Path, **options: Any) -> Iterator[ServiceUnderTest]:
    under_test = start_service(home, workspace, **options)
    try:
        yield under_test
    finally:
        under_test.service.close()
        under_test.service.store.close()
        stop_runners(home)
