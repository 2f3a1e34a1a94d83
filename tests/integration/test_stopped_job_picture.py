"""A job its user stopped is "stopped" everywhere: the service's record, its dashboard's job and tasks."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import pytest

from tensorfleet.testing.fleet import poll
from tensorfleet.testing.service import running_service

pytestmark = pytest.mark.cluster
PACED = Path(__file__).resolve().parent / "paced_job.py"


def test_a_stopped_jobs_dashboard_says_stopped_not_failed(tmp_path):
    workspace, home = tmp_path / "workspace", tmp_path / "home"
    workspace.mkdir()
    shutil.copy(PACED, workspace / "paced_job.py")
    with running_service(home, workspace) as service:
        api = service.client()
        fields = {"script": "paced_job.py", "args": ["--last_step", "100000", "--step_sleep_s", "0.02"],
                  "ps": 1, "workers": 2, "mode": "async"}
        job_id = api.call("POST", "/api/jobs", fields)["id"]

        def picture() -> dict:
            request = urllib.request.Request(f"{service.url}/jobs/{job_id}/dashboard/api/status",
                                             headers={"Authorization": f"Bearer {service.token}"})
            return json.loads(urllib.request.urlopen(request, timeout=10).read())

        poll(lambda: picture()["job"]["global_step"] > 10, 90, "the job to train")
        api.call("POST", f"/api/jobs/{job_id}/stop", {})
        poll(lambda: service.job(job_id)["state"] != "running", 60, "the job to end", interval_s=0.2)
        assert service.job(job_id)["state"] == "stopped"
        shown = poll(lambda: (p := picture())["job"]["state"] != "running" and p, 10, "the final picture")
        assert shown["job"]["state"] == "stopped"
        assert {task["state"] for task in shown["tasks"]} <= {"stopped", "done"}, shown["tasks"]
