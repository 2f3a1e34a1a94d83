"""A real Dashboard on a free port over a dict the test changes: every route over HTTP, and a clean stop."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tensorfleet.dashboard import Dashboard
from tensorfleet.errors import LaunchError
from tensorfleet.testing.fake_monitor import FakeMonitor, serving

TIMEOUT_S = 5


def fake_state() -> dict:
    return {
        "job": {"name": "mnist_mlp", "mode": "async", "state": "running", "global_step": 1234,
                "target_step": 10000, "steps_per_sec": 512.3, "examples_per_sec": 51230.0, "eta_s": 17.2,
                "dropped_stale": 0, "elapsed_s": 12.3, "restarts": 1},
        "tasks": [
            {"name": "ps:0", "role": "ps", "address": "127.0.0.1:41234", "state": "running", "pid": 123,
             "restarts": 0, "step": 1234, "global_step": 1234, "loss": None, "examples_per_sec": None,
             "heartbeat_age_s": 0.4, "exit_code": None},
            {"name": "worker:0", "role": "chief", "address": "127.0.0.1:41235", "state": "running",
             "pid": 124, "restarts": 1, "step": 600, "global_step": 1230, "loss": 0.23,
             "examples_per_sec": 2500.0, "heartbeat_age_s": 0.2, "exit_code": None},
        ],
        "history": [{"t": 3.0, "global_step": 800, "loss": 0.41, "examples_per_sec": 50000.0,
                     "steps_per_sec": 500.0}],
    }


@pytest.fixture
def fleet() -> FakeMonitor:
    return FakeMonitor(fake_state())


@pytest.fixture
def dashboard(fleet: FakeMonitor) -> Iterator[Dashboard]:
    with serving(fleet) as dashboard:
        yield dashboard


def get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        return response.status, response.headers["Content-Type"], response.read()


def test_url_names_the_bound_loopback_port(dashboard: Dashboard):
    assert dashboard.url.startswith("http://127.0.0.1:")
    assert dashboard.url.endswith("/")
    assert int(dashboard.url.rstrip("/").rsplit(":", 1)[1]) > 0


def test_page_and_its_static_files(dashboard: Dashboard):
    status, content_type, body = get(dashboard.url)
    assert status == 200 and content_type.startswith("text/html")
    page = body.decode()
    assert 'src="static/app.js"' in page
    assert 'id="global-step"' in page and 'id="connection"' in page

    for path, kind in [("static/app.js", "javascript"), ("static/style.css", "text/css"),
                       ("static/vendor/uplot/uPlot.iife.min.js", "javascript"),
                       ("static/vendor/uplot/uPlot.min.css", "text/css")]:
        status, content_type, body = get(dashboard.url + path)
        assert status == 200 and kind in content_type and body, path
    assert b"api/status" in get(dashboard.url + "static/app.js")[2]

    with pytest.raises(urllib.error.HTTPError) as missing:
        get(dashboard.url + "static/no-such-file.js")
    assert missing.value.code == 404


def test_api_status_is_the_current_picture(dashboard: Dashboard, fleet: FakeMonitor):
    status, content_type, body = get(dashboard.url + "api/status")
    assert status == 200 and content_type == "application/json"
    assert json.loads(body) == fleet.picture().to_json()

    with fleet.lock:
        fleet.state["job"]["global_step"] = 2000
        fleet.state["tasks"][1]["state"] = "restarting"
    assert json.loads(get(dashboard.url + "api/status")[2]) == fleet.picture().to_json()


def test_api_status_turns_a_nan_loss_into_null(dashboard: Dashboard, fleet: FakeMonitor):
    with fleet.lock:
        fleet.state["tasks"][1]["loss"] = float("nan")
    assert json.loads(get(dashboard.url + "api/status")[2])["tasks"][1]["loss"] is None


def test_metrics(dashboard: Dashboard, fleet: FakeMonitor):
    status, content_type, body = get(dashboard.url + "metrics")
    assert status == 200 and content_type.startswith("text/plain; version=")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    assert samples[("tensorfleet_global_step", ())] == 1234
    assert samples[("tensorfleet_task_up", (("role", "chief"), ("task", "worker:0")))] == 1

    with fleet.lock:
        fleet.state["job"]["global_step"] = 1500
    assert "tensorfleet_global_step 1500.0" in get(dashboard.url + "metrics")[2].decode()


def test_healthz(dashboard: Dashboard):
    assert get(dashboard.url + "healthz")[:2] == (200, "text/plain; charset=utf-8")


def test_stop_closes_the_port_and_ends_the_thread(fleet: FakeMonitor):
    before = set(threading.enumerate())
    dashboard = Dashboard(fleet.picture)
    assert dashboard.start() is dashboard
    url = dashboard.url
    port = int(url.rstrip("/").rsplit(":", 1)[1])
    get(url + "healthz")
    dashboard.stop()

    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S).close()
    assert not any(t.name == "tensorfleet-dashboard" for t in threading.enumerate())
    # Starlette's worker threads (anyio) are told to exit when the server's loop ends; they do so promptly.
    deadline = time.monotonic() + TIMEOUT_S
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) - before == set()
    dashboard.stop()  # twice is harmless


def test_start_leaves_signal_handlers_alone(fleet: FakeMonitor):
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with Dashboard(fleet.picture) as dashboard:
        get(dashboard.url + "healthz")
        assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


def test_a_taken_port_fails_in_start(dashboard: Dashboard, fleet: FakeMonitor):
    port = int(dashboard.url.rstrip("/").rsplit(":", 1)[1])
    with pytest.raises(OSError):
        Dashboard(fleet.picture, port=port).start()


def test_start_twice_is_an_error(dashboard: Dashboard):
    with pytest.raises(LaunchError):
        dashboard.start()
