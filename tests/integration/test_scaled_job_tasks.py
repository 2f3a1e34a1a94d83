"""After a scale-down, the job service still knows every task the job had: what each was started with, and the
logs of those scaled away."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tensorfleet.testing.fleet import poll
from tensorfleet.testing.service import running_service

pytestmark = pytest.mark.cluster
SCALE_JOB = Path(__file__).resolve().parent / "scale_job.py"


def workers_in(env: dict) -> int:
    return len(json.loads(env["TF_CONFIG"])["cluster"]["worker"])


def test_removed_workers_stay_listed_with_their_logs_and_tasks_keep_what_they_started_with(tmp_path):
    workspace, home = tmp_path / "workspace", tmp_path / "home"
    workspace.mkdir()
    shutil.copy(SCALE_JOB, workspace / "scale_job.py")
    last_step = tmp_path / "last_step"
    with running_service(home, workspace) as service:
        api = service.client()
        job_id = api.call("POST", "/api/jobs", {"script": "scale_job.py", "workers": 3, "mode": "async",
                                                "args": ["--last_step_file", str(last_step)]})["id"]
        tasks = lambda: api.call("GET", f"/api/jobs/{job_id}/tasks")["tasks"]  # noqa: E731
        poll(lambda: service.job(job_id)["progress"]["global_step"], 90, "training to start", interval_s=0.2)
        api.call("POST", f"/api/jobs/{job_id}/scale", {"workers": 2})
        launcher_log = lambda: api.call("GET", f"/api/jobs/{job_id}/logs/launcher")["text"]  # noqa: E731
        poll(lambda: "worker:2 left the job" in launcher_log(), 90, "worker:2 to leave")
        tasks_file = home / "jobs" / str(job_id) / "tasks.json"
        removed = poll(lambda: (r := {t["name"]: t["removed"] for t in json.loads(tasks_file.read_text())})
                       ["worker:2"] and r, 30, "the runner to list worker:2 removed")
        assert removed == {"ps:0": False, "worker:0": False, "worker:1": False, "worker:2": True}
        listed = {task["name"]: task for task in tasks()}
        # Every task still running was started in a fleet of 3 workers: that is what it was given, not the new 2.
        assert [workers_in(listed[name]["env"]) for name in ("ps:0", "worker:0", "worker:1")] == [3, 3, 3]
        assert "worker:2 starts at global step" in api.call("GET", f"/api/jobs/{job_id}/logs/worker:2")["text"]
        last_step.write_text("1")
        poll(lambda: service.job(job_id)["state"] != "running", 90, "the job to end", interval_s=0.2)
        assert service.job(job_id)["state"] == "succeeded", service.job(job_id)["reason"]
